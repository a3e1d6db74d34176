"""Qwen3.5-MoE checkpoints as they are published, each layer's experts fused into one gate_up_proj and one down_proj
tensor: loaded eagerly and lazily (the uploader's byte spans) to the same weights as transformers' per-expert form,
and a fused tensor of the wrong rank refused in one line."""

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pegainfer.errors import CheckpointError
from pegainfer.frontends.load import load_model

EXPERTS = 8  # qwen3_5_moe's TINY_CONFIG


def fuse(source: Path, out: Path, wrap=lambda t: t) -> Path:
    """A copy of the per-expert checkpoint `source` with its experts fused as the published checkpoints store them."""
    shutil.copytree(source, out)
    tensors = load_file(source / "model.safetensors")
    fused: dict[str, np.ndarray] = {}
    prefixes = sorted({name.split(".experts.")[0] for name in tensors if ".experts." in name})
    for prefix in prefixes:
        expert = [f"{prefix}.experts.{e}" for e in range(EXPERTS)]
        fused[f"{prefix}.experts.gate_up_proj"] = np.stack(
            [np.concatenate([tensors.pop(f"{e}.gate_proj.weight"), tensors.pop(f"{e}.up_proj.weight")]) for e in expert])
        fused[f"{prefix}.experts.down_proj"] = np.stack([tensors.pop(f"{e}.down_proj.weight") for e in expert])
    (out / "model.safetensors").unlink()
    save_file(wrap(tensors | fused), str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def per_expert(checkpoint_factory) -> Path:
    return checkpoint_factory("qwen3_5_moe")


def test_fused_experts_load_to_the_per_expert_weights_eagerly_and_by_byte_spans(per_expert, tmp_path):
    fused = fuse(per_expert, tmp_path / "fused")
    expected = load_model(per_expert).weights
    eager, lazy = load_model(fused).weights, load_model(fused, lazy=True).weights
    assert set(eager) == set(expected) and any(".experts.7.up_proj" in name for name in expected)
    for name, value in expected.items():
        assert np.array_equal(eager[name], value) and np.array_equal(lazy[name], value), name
    span = lazy.span("model.layers.1.mlp.experts.5.up_proj.weight")
    read = np.fromfile(span.file, dtype=np.float32, count=span.nbytes // 4, offset=span.offset)
    assert np.array_equal(read.reshape(32, 64), expected["model.layers.1.mlp.experts.5.up_proj.weight"])


def test_a_fused_expert_tensor_of_the_wrong_rank_is_refused_in_one_line(per_expert, tmp_path):
    def flatten(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        name = "model.layers.0.mlp.experts.down_proj"
        return tensors | {name: tensors[name].reshape(EXPERTS * 64, 32)}
    broken = fuse(per_expert, tmp_path / "broken", flatten)
    with pytest.raises(CheckpointError, match=r"fused expert tensor 'model.layers.0.mlp.experts.down_proj' has "
                                              r"shape \[512, 32\], expected \[experts, down rows, in-features\]"):
        load_model(broken)
