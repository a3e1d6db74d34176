"""FP8 experts (an FP8 checkpoint's stacked e4m3 weights, each projection with its own blocks of scales) in both
variants of the moe_experts kernel under TRITON_INTERPRET, against ir/ops/moe.py's `_experts` on the dequantized
weights (rounded to bf16, as the model's dequantize rounds them): blocks that cut projections short, several blocks
a projection, and a scale per output row. And a Qwen3-MoE checkpoint in either FP8 format on the CPU engine against
Hugging Face float32 on its dequantized weights."""

import json

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.spec import pick_variant
from pegainfer.backends.triton.execute import to_numpy
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.errors import ConfigError, GraphError
from pegainfer.frontends.load import load_model, load_spec, resolve_config_path
from pegainfer.ir import GraphBuilder, dtype_from_name
from pegainfer.ir.dtypes import F8E4M3, FP32, INT32
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.ops.moe import _experts, stacked_dequantize
from pegainfer.ir.ops.quantize import scale_shape
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.reference_engine import ReferenceEngine
from golden_configs import GOLDEN_CONFIGS
from test_latent_fp8 import dequantized_copy
from test_moe_grouped import relative_error, run_variant, skewed_routing

HIDDEN, INTER, EXPERTS, K = 72, 40, 8, 2
BLOCKS = {"one_block_a_projection": (128, 128), "blocks_of_16x32": (16, 32), "per_row": (1, HIDDEN)}


def fp8_graph(block: tuple[int, int]):
    b = GraphBuilder("experts")
    bf16 = dtype_from_name("bf16")
    x = b.input("x", bf16, ("tokens", HIDDEN))
    weights = b.input("weights", bf16, ("tokens", K))
    ids = b.input("ids", INT32, ("tokens", K))
    gate_up = b.param("gate_up", F8E4M3, (EXPERTS * 2 * INTER, HIDDEN))
    down = b.param("down", F8E4M3, (EXPERTS * HIDDEN, INTER))
    rows, cols = scale_shape((INTER, HIDDEN), block)
    gate_up_scale = b.param("gate_up_scale", FP32, (2 * EXPERTS * rows, cols))
    rows, cols = scale_shape((HIDDEN, INTER), block)
    down_scale = b.param("down_scale", FP32, (EXPERTS * rows, cols))
    return b.finish(b.moe_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale, experts=EXPERTS,
                                  act="silu", block=list(block), name="experts"))


def fp8_params(rng, graph) -> dict[str, np.ndarray]:
    types = graph.params
    return {name: (rng.standard_normal(t.shape) * 64).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
            if t.dtype == F8E4M3 else (rng.random(t.shape) * 0.01 + 0.001).astype(np.float32)
            for name, t in types.items()}


@pytest.mark.parametrize("rows", [1, 5, 90], ids=["gemv", "grouped_pairs", "grouped"])
@pytest.mark.parametrize("block", BLOCKS.values(), ids=BLOCKS.keys())
def test_fp8_experts_match_the_reference_on_their_dequantized_weights(block, rows):
    graph = fp8_graph(block)
    lowered, _ = lower(graph)
    (node,) = [n for n in lowered.nodes if n.op == KERNEL]
    spec = plan_kernel(lowered, node, PlanOptions())
    variant = pick_variant(spec, {"tokens": rows})
    assert variant.name == {1: "gemv_1", 5: "grouped_pairs", 90: "grouped_64"}[rows]
    rng = np.random.default_rng(rows)
    params = fp8_params(rng, graph)
    ids = skewed_routing(rng, rows, EXPERTS, K, (5,), 2)
    routing = rng.random((rows, K)) + 0.1
    inputs = {"x": rng.standard_normal((rows, HIDDEN)).astype(ml_dtypes.bfloat16),
              "weights": (routing / routing.sum(-1, keepdims=True)).astype(ml_dtypes.bfloat16), "ids": ids}
    f32 = {name: a.astype(np.float32) for name, a in inputs.items() if name != "ids"}
    as_bf16 = {name: stacked_dequantize(params[name], params[f"{name}_scale"], count, list(block))
               .astype(ml_dtypes.bfloat16).astype(np.float32) for name, count in (("gate_up", 2 * EXPERTS),
                                                                                   ("down", EXPERTS))}
    expected = _experts(f32["x"], f32["weights"], ids, as_bf16["gate_up"], as_bf16["down"], experts=EXPERTS,
                        act="silu")
    got = to_numpy(run_variant(spec, variant, inputs, params, rows)["experts"])
    assert np.isfinite(got).all()
    assert relative_error(got, expected) < 1e-2


def test_the_reference_dequantizes_each_projection_by_its_own_blocks():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2 * 5, 3)).astype(ml_dtypes.float8_e4m3fn)
    scale = np.array([[2.0], [3.0], [5.0], [7.0]], np.float32)  # blocks of 4 rows: two a projection of 5
    got = stacked_dequantize(q, scale, 2, [4, 3])
    wanted = q.astype(np.float32) * np.array([2, 2, 2, 2, 3, 5, 5, 5, 5, 7], np.float32)[:, None]
    np.testing.assert_array_equal(got, wanted)


def test_fp8_experts_without_their_scales_or_with_the_wrong_ones_are_refused():
    b = GraphBuilder("experts")
    bf16 = dtype_from_name("bf16")
    x = b.input("x", bf16, ("tokens", HIDDEN))
    weights, ids = b.input("weights", bf16, ("tokens", K)), b.input("ids", INT32, ("tokens", K))
    gate_up = b.param("gate_up", F8E4M3, (EXPERTS * 2 * INTER, HIDDEN))
    down = b.param("down", F8E4M3, (EXPERTS * HIDDEN, INTER))
    with pytest.raises(GraphError, match="FP8 experts take both weights in FP8, their two scales and a block"):
        b.moe_experts(x, weights, ids, gate_up, down, experts=EXPERTS, act="silu")
    wrong = b.param("wrong", FP32, (EXPERTS, 1))
    with pytest.raises(GraphError, match=r"gate_up's scales must be f32\[16,1\]"):
        b.moe_experts(x, weights, ids, gate_up, down, wrong, wrong, experts=EXPERTS, act="silu", block=[128, 128])


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-channel"])
def test_an_fp8_moe_checkpoint_runs_as_hugging_face_does_on_its_dequantized_weights(checkpoint_factory, tmp_path,
                                                                                     fmt):
    folder = checkpoint_factory(f"qwen3_moe_{fmt}", quantization=fmt, architecture="Qwen3MoeForCausalLM")
    ours = load_model(folder)
    params = ours.spec.graph.checkpoint_params()
    assert params["model.layers.0.mlp.experts.1.down_proj.weight"].dtype == F8E4M3
    assert params["model.layers.0.mlp.gate.weight"].dtype != F8E4M3
    assert prefill_error_against_dequantized(ours, folder, tmp_path, lowered=True) < 1e-4


def test_regrouped_fp8_rows_take_their_scales_rows_and_split_blocks_are_refused_in_one_line(tmp_path):
    """Qwen3.5's q_proj is regrouped at load (each head's q rows, then its gate rows): from an FP8 checkpoint its
    e4m3 rows and their 128-row blocks of scales come along; where a head's rows would cut a block, one line."""
    raw = json.loads(resolve_config_path("qwen3.5-0.8b").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    derived = load_spec(tmp_path / "config.json").graph.derivations()
    grouped, scales = (derived[f"model.layers.3.self_attn.q_proj.weight.grouped{suffix}"]
                       for suffix in ("", "_scale_inv"))
    assert grouped.source_types[0].dtype == F8E4M3 and grouped.rows[:2] == ((0, 0, 256), (0, 512, 768))
    assert scales.sources == ("model.layers.3.self_attn.q_proj.weight_scale_inv",)
    assert scales.rows[:2] == ((0, 0, 2), (0, 4, 6)) and scales.source_types[0].shape == (32, 8)  # 4096 x 1024
    raw["text_config"]["head_dim"] = 64  # a head's 64 q rows: half a block of scales
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"q_proj.weight.grouped is made at load from rows of .*q_proj.weight that "
                                          r"do not keep its 128-row scale blocks whole"):
        load_spec(tmp_path / "config.json")


@pytest.mark.parametrize("lowered", [False, True], ids=["declared", "lowered"])
def test_a_qwen3_5_checkpoint_with_a_scale_per_channel_runs_as_hugging_face_on_its_dequantized_weights(
        checkpoint_factory, tmp_path, lowered):
    folder = checkpoint_factory("qwen3_5_fp8_channel", GOLDEN_CONFIGS["qwen3_5_hybrid"][1],
                                architecture="Qwen3_5ForCausalLM", quantization="fp8-channel")
    ours = load_model(folder)
    assert ours.spec.graph.checkpoint_params()["model.layers.3.self_attn.q_proj.weight"].dtype == F8E4M3
    assert prefill_error_against_dequantized(ours, folder, tmp_path, lowered) < 1e-4


def test_qwen3_5_quantized_at_load_runs_as_hugging_face_on_the_same_fp8_weights(checkpoint_factory):
    """`--quantization fp8` on a float Qwen3.5 checkpoint: its regrouped q_proj quantized row by row at load like
    every projection, then regrouped with its scales."""
    from pegainfer.fixtures.checkpoint import fp8_channel_weights

    folder = checkpoint_factory("qwen3_5_hybrid")
    ours = load_model(folder, quantization="fp8")
    assert ours.weights["model.layers.3.self_attn.q_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    quantized = {name for name, t in ours.spec.graph.checkpoint_params().items() if t.dtype == F8E4M3}
    with torch.no_grad():
        for name, module in theirs.named_modules():
            if f"{name}.weight" in quantized:
                values, scale = fp8_channel_weights(module.weight, torch)
                module.weight.copy_(values.float() * scale)
        prompt = list(range(20, 53))
        expected = theirs(torch.tensor([prompt])).logits[0].numpy()
    got = ReferenceEngine(ours, max_tokens=64).step([Chunk(Sequence(0, prompt), len(prompt))], all_logits=True)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-4


def test_a_moe_checkpoint_quantized_at_load_runs_as_its_weights_quantized_by_torch(checkpoint_factory, tmp_path):
    """`--quantization fp8` on a float Qwen3-MoE checkpoint: every expert's projections quantized row by row at
    load, as the dense ones are, against the same checkpoint with each of those weights quantized and dequantized
    by torch (fixtures' fp8_channel_weights) loaded as it is."""
    from safetensors.torch import load_file, save_file

    from pegainfer.fixtures.checkpoint import fp8_channel_weights

    folder = checkpoint_factory("qwen3_moe_topk")
    ours = load_model(folder, quantization="fp8")
    fp8 = {name for name, t in ours.spec.graph.checkpoint_params().items() if t.dtype == F8E4M3}
    assert any(".experts.3." in name for name in fp8) and "model.layers.0.mlp.gate.weight" not in fp8
    copy = tmp_path / "rounded"
    copy.mkdir()
    for path in folder.iterdir():
        if path.suffix != ".safetensors":
            (copy / path.name).write_bytes(path.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    for name in fp8:
        values, scale = fp8_channel_weights(tensors[name], torch)
        tensors[name] = (values.float() * scale.float()).to(tensors[name].dtype)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    prompt = list(range(20, 53))
    got, expected, unquantized = (
        ReferenceEngine(model, max_tokens=64).step([Chunk(Sequence(0, prompt), len(prompt))], all_logits=True)
        for model in (ours, load_model(copy), load_model(folder)))
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-5
    assert np.abs(got - unquantized).max() / np.abs(unquantized).max() > 1e-3  # FP8 moved the logits


def prefill_error_against_dequantized(ours, folder, tmp_path, lowered: bool) -> float:
    """The largest gap of our prefill logits (the graph as declared or lowered) from Hugging Face float32's on the
    FP8 checkpoint's dequantized weights, relative to the largest logit."""
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        dequantized_copy(folder, tmp_path / "dequantized"), dtype=torch.float32, attn_implementation="eager").eval()
    prompts = ([3, 17, 40, 5, 99], [7], list(range(20, 53)))
    engine = ReferenceEngine(ours, max_tokens=256, graph=lower(ours.spec.graph)[0] if lowered else None)
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    logits = engine.step([Chunk(s, len(s.token_ids)) for s in seqs], all_logits=True)
    with torch.no_grad():
        expected = np.concatenate([theirs(torch.tensor([p])).logits[0].numpy() for p in prompts])
    return float(np.abs(logits - expected).max() / np.abs(expected).max())
