"""The GEMM variants on FP8 weights (the dequantize folded into the GEMM: values read as float8 e4m3, scaled in
registers), every tile of every slot, under TRITON_INTERPRET against the kernel's ops run by their references
(dequantize, then the GEMM): scales per output channel and per block, on the plain projection, the fused residual
add + RMSNorm + QKV projection and gate/up with its SiLU x up epilogue; the passes' merges and fusions of FP8
weights; whole steps of a small FP8 model made of generated kernels against the reference interpreter."""

import dataclasses
import re

import ml_dtypes
import numpy as np
import pytest
import torch

from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.triton.execute import InterpretedExecutor, launch_kernel, to_numpy, to_torch
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.errors import PegainferError
from pegainfer.frontends.quantization import Fp8Weights, quantize_graph
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.kernel import fused_ops
from pegainfer.models import qwen3
from pegainfer.passes.pipeline import lower
from random_models import BLOCK_SIZE
from test_archs_triton import relative_error, workload
from test_gemv_variants import run_reference

ROWS = 3
KINDS = ["dequantize_linear", "dequantize_add_rms_norm_linear", "dequantize_add_rms_norm_linear_silu_mul"]
SCHEMES = {"channel": Fp8Weights(None, "_scale"), "block": Fp8Weights((16, 16), "_scale_inv")}


def fp8_layer(scheme: Fp8Weights, hidden: int = 64, intermediate: int = 96, layers: int = 1,
              dtype: str = "float32"):
    config = qwen3.Config(vocab_size=64, hidden_size=hidden, intermediate_size=intermediate,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=hidden // 4, rms_norm_eps=1e-6, rope_theta=1e4, attention_bias=False,
                          tie_word_embeddings=True, torch_dtype=dtype)
    return lower(quantize_graph(qwen3.build_graph(config), scheme, dtype_from_name(dtype)))[0]


def fp8_values(rng: np.random.Generator, shape) -> np.ndarray:
    return np.clip(rng.standard_normal(shape) * 64, -448, 448).astype(ml_dtypes.float8_e4m3fn)


def kernel_inputs(body, node, rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Random rows of ROWS tokens; FP8 values with scales of a few hundredths (products of about unit size)."""
    types = body.value_types()
    inputs = {}
    for value in node.inputs:
        t = types[value]
        shape = [ROWS if isinstance(d, str) else d for d in t.shape]
        if t.dtype.name == "f8e4m3":
            inputs[value] = fp8_values(rng, shape)
        elif value.endswith(("_scale", "_scale_inv")):
            inputs[value] = rng.uniform(0.002, 0.02, shape).astype(np.float32)
        else:
            inputs[value] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return inputs


def each_variant(graph, kind: str):
    body = next(g for g in graph.all_graphs() for n in g.nodes if n.op == KERNEL and n.attrs["kind"] == kind)
    node = next(n for n in body.nodes if n.op == KERNEL and n.attrs["kind"] == kind)
    spec = plan_kernel(body, node, PlanOptions(block_size=16))
    return body, node, spec


@pytest.fixture(scope="module", params=sorted(SCHEMES))
def scheme_graph(request):
    return request.param, fp8_layer(SCHEMES[request.param])


def test_fp8_projections_merge_and_fold_their_dequantize_into_the_gemm(scheme_graph):
    _, graph = scheme_graph
    kinds = {n.attrs["kind"]: fused_ops(n) for g in graph.all_graphs() for n in g.nodes if n.op == KERNEL}
    assert set(KINDS) <= set(kinds), sorted(kinds)
    assert "dequantize" not in kinds  # never a kernel of its own: the bf16 weight is never written
    body = next(g for g in graph.all_graphs() if any(n.op == KERNEL and n.attrs["kind"] == KINDS[1]
                                                      for n in g.nodes))
    merged = [p for p in body.derived if p.endswith(("weight", "weight_scale", "weight_scale_inv"))]
    assert len(merged) == 4, merged  # QKV's and gate/up's values and scales, concatenated by the loader


@pytest.mark.parametrize("kind", KINDS)
def test_every_fp8_gemm_variant_matches_dequantize_then_the_reference_gemm(scheme_graph, kind):
    name, graph = scheme_graph
    body, node, spec = each_variant(graph, kind)
    assert {v.name for v in spec.variants} >= {"gemv_1", "dot_16", "dot_32", "dot_64"}
    rng = np.random.default_rng(4)
    inputs = kernel_inputs(body, node, rng)
    expected = run_reference(node, inputs)
    for variant in spec.variants:
        assert variant.launches[-1].constexprs["SCALE"] == (1 if name == "channel" else 2)
        chosen = dataclasses.replace(spec, variants=[dataclasses.replace(variant, max_rows=None)])
        got = launch_kernel(chosen, node, {n: to_torch(a) for n, a in inputs.items()}, {"tokens": ROWS})
        for out in node.outputs:
            np.testing.assert_allclose(to_numpy(got[out]), expected[out], rtol=1e-4, atol=1e-4,
                                       err_msg=f"{variant.name} (rows <= {variant.max_rows}): {out}")


@pytest.mark.parametrize("kind", ["dequantize_linear", "dequantize_add_rms_norm_linear_silu_mul"])
def test_the_split_gemm_on_128_wide_scale_blocks_matches_the_reference(kind):
    """K of 1024 over 128 x 128 blocks (Qwen's FP8 checkpoints): the split tiles' K slices and the wide tiles'
    K tiles each within one block."""
    graph = fp8_layer(Fp8Weights((128, 128), "_scale_inv"), hidden=1024, intermediate=1024)
    body, node, spec = each_variant(graph, kind)
    rng = np.random.default_rng(5)
    inputs = kernel_inputs(body, node, rng, scale=0.1)
    expected = run_reference(node, inputs)
    split = [v for v in spec.variants if v.name == "split_k_16"]
    assert split and all(v.launches[-1].constexprs["BLOCK_K"] <= 128 for v in spec.variants)
    for variant in [split[0], next(v for v in spec.variants if v.name == "gemv_1")]:
        chosen = dataclasses.replace(spec, variants=[dataclasses.replace(variant, max_rows=None)])
        scratch = {n: torch.zeros(shape, dtype=torch.float32 if dtype == "f32" else torch.int32)
                   for n, (dtype, shape) in chosen.scratch.items() if n.startswith("gemm.split")}
        got = launch_kernel(chosen, node, {n: to_torch(a) for n, a in inputs.items()} | scratch, {"tokens": ROWS})
        for out in node.outputs:
            scale = np.abs(expected[out]).max()
            np.testing.assert_allclose(to_numpy(got[out]), expected[out], rtol=1e-4, atol=1e-5 * scale,
                                       err_msg=f"{variant.name}: {out}")


def test_scale_blocks_the_tiles_cannot_stay_within_are_refused():
    graph = fp8_layer(Fp8Weights((16, 48), "_scale_inv"), hidden=96, intermediate=96)
    body = next(g for g in graph.all_graphs() if any(n.op == KERNEL and n.attrs["kind"] == KINDS[0]
                                                      for n in g.nodes))
    node = next(n for n in body.nodes if n.op == KERNEL and n.attrs["kind"] == KINDS[0])
    with pytest.raises(PegainferError, match="scale blocks 48 columns wide"):
        plan_kernel(body, node, PlanOptions(block_size=16))


def test_steps_of_an_fp8_model_made_of_generated_kernels_match_the_reference():
    """Two layers, block scales: a packed prefill, a mixed step and batch 1, as test_archs_triton's steps."""
    graph = fp8_layer(SCHEMES["block"], layers=2)
    rng = np.random.default_rng(3)
    weights = {}
    for name, t in graph.checkpoint_params().items():
        if t.dtype.name == "f8e4m3":
            weights[name] = fp8_values(rng, t.shape)
        elif name.endswith("_scale_inv"):
            weights[name] = rng.uniform(0.002, 0.01, t.shape).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(t.shape) * 0.5).astype(t.dtype.np_dtype)
    weights |= {n: np.concatenate([weights[s] for s in d.sources]) for n, d in graph.derivations().items()}
    specs = {(g.name, n.name): plan_kernel(g, n, PlanOptions(block_size=BLOCK_SIZE))
             for g in graph.all_graphs() for n in g.nodes if n.op == KERNEL}
    model = dataclasses.make_dataclass("Model", ["dtype", "vocab", "lowered"])("float32", 64, graph)
    expected = workload(model, lambda inputs, states: run_graph(graph, inputs, weights, states))
    executor = InterpretedExecutor(graph, specs)
    got = workload(model, lambda inputs, states: executor.run(
        inputs, weights, {n: to_torch(s) for n, s in states.items()}))
    for ours, theirs in zip(got, expected):
        assert relative_error(ours[0], theirs[0]) < 1e-5
        assert (ours[0].argmax(-1) == theirs[0].argmax(-1)).all()


def test_fp8_gemms_compile_for_sm89_and_sm90_converting_fp8_in_registers(tmp_path):
    """The batch-1 GEMV and the prefill tile of gate/up on 128 x 128 blocks: cubins for sm_89 and sm_90 that read
    e4m3 weights, not bf16 ones: the GEMV turns pairs into halves (F2FP ... E4M3), the tensor-core tile moves their
    bits into bf16 (PRMT, no quarter-rate F2F.BF16.F16 an element)."""
    from pegainfer.backends.build import compile_many
    from test_native_backends import sass

    graph = fp8_layer(Fp8Weights((128, 128), "_scale_inv"), hidden=1024, intermediate=1024, dtype="bfloat16")
    _, _, spec = each_variant(graph, KINDS[2])
    launches = {v.name: v.launches[-1] for v in spec.variants if v.max_rows in (1, None)}
    assert all(next(p for p in launches[name].params if p.name == "w_ptr").dtype == "*fp8e4nv"
               for name in ("gemv_1", "dot_64"))
    todo = {(sm, name): launches[name] for sm in (89, 90) for name in ("gemv_1", "dot_64")}
    for (sm, name), compiled in compile_many(todo, 2, None):
        text = sass(compiled.cubin, tmp_path)
        if name == "gemv_1":
            assert re.search(r"F2FP\.\S*E4M3", text), (name, sm)
        else:
            assert "PRMT" in text and re.search(r"HG?MMA", text) and "F2F.BF16.F16" not in text, (name, sm)
