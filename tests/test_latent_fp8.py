"""DeepSeek-V3-style FP8 checkpoints (block-scaled e4m3 projections, experts included; the router kept in bf16, as
the published ones are): the graph reads what they store, kv_b is dequantized at load for the absorbed form, and
the model runs as Hugging Face float32 does on the dequantized weights, as declared and as lowered."""

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pegainfer.frontends.load import load_model
from pegainfer.ir.dtypes import F8E4M3
from pegainfer.ir.printer import format_graph
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.reference_engine import ReferenceEngine

PROMPTS = ([3, 17, 40, 5, 99], [7], list(range(20, 53)))
DECODE_STEPS = 8


@pytest.fixture(scope="module")
def fp8_v3(checkpoint_factory):
    return checkpoint_factory("deepseek_v3_grouped_fp8", quantization="fp8-block",
                              architecture="DeepseekV3ForCausalLM")


def dequantized_copy(folder, out):
    """The checkpoint in float32, each FP8 weight times its 128 x 128 blocks' scales or its rows' (by torch, apart
    from the op under test), for Hugging Face to load under its own names."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((folder / name).read_bytes())
    (out / "config.json").write_text(json.dumps(config))
    stored = load_file(folder / "model.safetensors")
    state = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale_inv", "_scale")):
            continue
        if tensor.dtype == torch.float8_e4m3fn and f"{name}_scale" in stored:
            tensor = tensor.float() * stored[f"{name}_scale"].float()
        elif tensor.dtype == torch.float8_e4m3fn:
            scale = stored[f"{name}_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            tensor = tensor.float() * scale[: tensor.shape[0], : tensor.shape[1]]
        state[name] = tensor.float()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_the_graph_reads_fp8_projections_and_experts_and_a_bf16_router(fp8_v3):
    model = load_model(fp8_v3)
    params = model.spec.graph.checkpoint_params()
    assert params["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == F8E4M3
    assert "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv" in params
    assert params["model.layers.1.mlp.gate.weight"].dtype != F8E4M3
    assert "model.layers.1.mlp.gate.weight_scale_inv" not in params
    assert params["model.layers.1.self_attn.kv_b_proj.weight"].dtype == F8E4M3
    lowered, _ = lower(model.spec.graph)
    text = format_graph(lowered)
    assert "kv_b_proj.keys.weight: f32[64,32] = rows [0:16], [28:44]" in text
    assert "of dequantize(@model.layers.{layer+1}.self_attn.kv_b_proj.weight, " in text
    assert "mla_attention" not in text and "block=[128, 128], experts=8" in text


@pytest.mark.parametrize("lowered", [False, True], ids=["declared", "lowered"])
def test_an_fp8_checkpoint_runs_as_hugging_face_does_on_its_dequantized_weights(fp8_v3, tmp_path, lowered):
    ours = load_model(fp8_v3)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        dequantized_copy(fp8_v3, tmp_path / "dequantized"), dtype=torch.float32, attn_implementation="eager").eval()
    engine = ReferenceEngine(ours, max_tokens=256, graph=lower(ours.spec.graph)[0] if lowered else None)
    seqs = [Sequence(i, list(p)) for i, p in enumerate(PROMPTS)]
    prefill = engine.step([Chunk(s, len(s.token_ids)) for s in seqs], all_logits=True)
    with torch.no_grad():
        expected = np.concatenate([theirs(torch.tensor([p])).logits[0].numpy() for p in PROMPTS])
    assert np.abs(prefill - expected).max() / np.abs(expected).max() < 1e-4
    logits = prefill[np.cumsum([len(p) for p in PROMPTS]) - 1]
    for step in range(DECODE_STEPS):
        for seq, token in zip(seqs, logits.argmax(-1)):
            seq.token_ids.append(int(token))
        with torch.no_grad():
            expected = np.stack([theirs(torch.tensor([s.token_ids])).logits[0, -1].numpy() for s in seqs])
        logits = engine.step([Chunk(s, 1) for s in seqs])
        assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4, f"decode step {step}"
