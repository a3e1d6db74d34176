"""A Qwen3.5 checkpoint's MTP head (mtp.*): its tensors checked against the DAG file's layout at load and kept, read
lazily, beside the model's weights; a head with a wrong shape, a missing or an extra tensor refused in one line."""

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pegainfer.errors import CheckpointError
from pegainfer.fixtures.checkpoint import make_checkpoint
from pegainfer.frontends.load import load_model, load_spec


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mtp"), "Qwen3_5ForCausalLM", {"mtp_num_hidden_layers": 1})


def with_head(plain: Path, out: Path, edit=lambda head: head) -> tuple[Path, dict[str, np.ndarray]]:
    """A copy of `plain` whose model.safetensors also holds a random MTP head (after `edit`)."""
    out.mkdir()
    for file in plain.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    spec = load_spec(plain / "config.json")
    rng = np.random.default_rng(0)
    head = edit({name: rng.standard_normal(t.shape).astype(np.float32)
                 for name, t in spec.dag.mtp_params(spec.config).items()})
    save_file(load_file(plain / "model.safetensors") | head, str(out / "model.safetensors"))
    return out, head


def test_the_mtp_head_is_checked_and_kept_beside_the_weights(plain, tmp_path):
    folder, head = with_head(plain, tmp_path / "head")
    model = load_model(folder)
    assert model.mtp is not None and set(model.mtp) == set(head)
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= set(head)
    assert model.mtp["mtp.fc.weight"].shape == (64, 128)
    for name, value in head.items():
        np.testing.assert_array_equal(model.mtp[name], value)
    assert not any(name.startswith("mtp.") for name in model.weights)
    assert load_model(plain).mtp is None


@pytest.mark.parametrize("edit,message", [
    (lambda h: h | {"mtp.fc.weight": h["mtp.fc.weight"][:, :64]}, r"'mtp.fc.weight' has shape \[64, 64\], "
                                                                  r"expected \[64, 128\]"),
    (lambda h: {k: v for k, v in h.items() if k != "mtp.norm.weight"}, r"'mtp.norm.weight' .* is missing"),
    (lambda h: h | {"mtp.layers.1.input_layernorm.weight": h["mtp.norm.weight"]},
     r"'mtp.layers.1.input_layernorm.weight' is not part of the MTP head of mtp_num_hidden_layers 1"),
])
def test_a_malformed_mtp_head_is_refused_in_one_line(plain, tmp_path, edit, message):
    folder, _ = with_head(plain, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(folder)
