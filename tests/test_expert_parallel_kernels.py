"""The MoE kernels of a rank under expert parallelism (a moe_experts node holding experts first_expert .. + E' of
the routed ones) under TRITON_INTERPRET, in each variant (the per-pair GEMVs, the grouped GEMMs a program a pair and
a few tiles a program), against ir/ops/moe.py's `_experts`: tokens routed to other ranks' experts alone (their rows
exactly zero), held experts with no token, scratch starting as NaN so that a row no launch wrote shows; FP8 experts
(each with its own scales) likewise; and the variants compile for sm_90."""

import ml_dtypes
import numpy as np
import pytest

from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.spec import pick_variant
from pegainfer.backends.triton.execute import to_numpy
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.errors import GraphError
from pegainfer.ir import GraphBuilder, dtype_from_name
from pegainfer.ir.dtypes import F8E4M3, FP32, INT32
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.ops.moe import _experts, stacked_dequantize
from pegainfer.ir.ops.quantize import scale_shape
from pegainfer.passes.pipeline import lower
from test_moe_grouped import relative_error, run_variant

HIDDEN, INTER, ROUTED, K = 40, 24, 24, 3
FIRST, HELD = 6, 6  # this rank's experts: 6 .. 11 of 24 (rank 1 of 4)
EMPTY = (8,)  # a held expert no token picks
ROWS = {"gemv_1": 2, "grouped_pairs": 6, "grouped_64": 70}
BLOCK = (16, 16)


def held_graph(dtype: str, fp8: bool = False):
    """A moe_experts node holding experts FIRST .. FIRST + HELD - 1 of ROUTED."""
    b = GraphBuilder("experts")
    t = dtype_from_name(dtype)
    x = b.input("x", t, ("tokens", HIDDEN))
    weights, ids = b.input("weights", t, ("tokens", K)), b.input("ids", INT32, ("tokens", K))
    stored = F8E4M3 if fp8 else t
    gate_up = b.param("gate_up", stored, (HELD * 2 * INTER, HIDDEN))
    down = b.param("down", stored, (HELD * HIDDEN, INTER))
    scales = []
    if fp8:
        for name, projections, shape in (("gate_up", 2 * HELD, (INTER, HIDDEN)), ("down", HELD, (HIDDEN, INTER))):
            rows, cols = scale_shape(shape, BLOCK)
            scales.append(b.param(f"{name}_scale", FP32, (projections * rows, cols)))
    block = {"block": list(BLOCK)} if fp8 else {}
    return b.finish(b.moe_experts(x, weights, ids, gate_up, down, *scales, experts=ROUTED, act="silu",
                                  first_expert=FIRST, name="experts", **block))


def routing(rng, rows: int) -> np.ndarray:
    """K distinct experts a token, none of EMPTY: a third of the tokens only other ranks' experts, the rest at
    least one held."""
    ids = np.zeros((rows, K), np.int32)
    held = [e for e in range(FIRST, FIRST + HELD) if e not in EMPTY]
    others = [e for e in range(ROUTED) if not FIRST <= e < FIRST + HELD]
    for row in range(rows):
        picked = rng.choice(others, K, replace=False)
        if row % 3:
            picked[0] = rng.choice(held)
        ids[row] = rng.permutation(picked)
    return ids


def case(rng, dtype: str, rows: int, graph) -> tuple[dict, dict]:
    np_dtype = dtype_from_name(dtype).np_dtype
    share = rng.random((rows, K)) + 0.1
    inputs = {"x": rng.standard_normal((rows, HIDDEN)).astype(np_dtype),
              "weights": (share / share.sum(-1, keepdims=True)).astype(np_dtype), "ids": routing(rng, rows)}
    params = {}
    for name, t in graph.params.items():
        if t.dtype == F8E4M3:
            params[name] = (rng.standard_normal(t.shape) * 64).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
        elif name.endswith("_scale"):
            params[name] = (rng.random(t.shape) * 0.01 + 0.001).astype(np.float32)
        else:
            params[name] = (rng.standard_normal(t.shape) * 0.2).astype(np_dtype)
    return inputs, params


def planned(graph):
    lowered, _ = lower(graph)
    (node,) = [n for n in lowered.nodes if n.op == KERNEL]
    return plan_kernel(lowered, node, PlanOptions())


def expected(inputs: dict, params: dict, fp8: bool) -> np.ndarray:
    f32 = {name: a.astype(np.float32) for name, a in inputs.items() if name != "ids"}
    if fp8:  # rounded to bf16 as the kernels' dequantize rounds them
        weights = {name: stacked_dequantize(params[name], params[f"{name}_scale"], count, list(BLOCK))
                   .astype(ml_dtypes.bfloat16).astype(np.float32)
                   for name, count in (("gate_up", 2 * HELD), ("down", HELD))}
    else:
        weights = {name: params[name].astype(np.float32) for name in ("gate_up", "down")}
    return _experts(f32["x"], f32["weights"], inputs["ids"], weights["gate_up"], weights["down"], experts=ROUTED,
                    act="silu", first_expert=FIRST)


@pytest.mark.parametrize("variant", ROWS)
@pytest.mark.parametrize("dtype, fp8", [("f32", False), ("bf16", True)], ids=["f32", "fp8"])
def test_each_variant_sums_the_held_experts_pairs_alone(variant, dtype, fp8):
    graph = held_graph(dtype, fp8)
    spec = planned(graph)
    rows = ROWS[variant]
    chosen = pick_variant(spec, {"tokens": rows})
    assert chosen.name == variant
    inputs, params = case(np.random.default_rng(rows), dtype, rows, graph)
    want = expected(inputs, params, fp8)
    got = to_numpy(run_variant(spec, chosen, inputs, params, rows)["experts"]).astype(np.float32)
    assert np.isfinite(got).all(), "a row left unwritten, or a scratch row of another rank's pair read"
    elsewhere = ~((inputs["ids"] >= FIRST) & (inputs["ids"] < FIRST + HELD)).any(axis=1)
    assert elsewhere.any() and (got[elsewhere] == 0).all() and (want[elsewhere] == 0).all()
    assert relative_error(got, want) < (1e-2 if fp8 else 1e-5)


def test_the_reference_sums_of_the_ranks_are_the_whole_layers():
    """Two ranks' nodes (experts 0-11 and 12-23) add up to one node holding all of them."""
    rng = np.random.default_rng(0)
    x, weights = rng.standard_normal((9, HIDDEN)), rng.random((9, K))
    ids = np.stack([rng.choice(ROUTED, K, replace=False) for _ in range(9)]).astype(np.int32)
    gate_up, down = rng.standard_normal((ROUTED * 2 * INTER, HIDDEN)), rng.standard_normal((ROUTED * HIDDEN, INTER))
    whole = _experts(x, weights, ids, gate_up, down, experts=ROUTED, act="silu")
    half = ROUTED // 2
    parts = [_experts(x, weights, ids, gate_up[r * half * 2 * INTER:(r + 1) * half * 2 * INTER],
                      down[r * half * HIDDEN:(r + 1) * half * HIDDEN], experts=ROUTED, act="silu",
                      first_expert=r * half) for r in range(2)]
    np.testing.assert_allclose(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


def test_held_experts_past_the_routed_ones_are_refused():
    b = GraphBuilder("experts")
    t = dtype_from_name("f32")
    x = b.input("x", t, ("tokens", HIDDEN))
    weights, ids = b.input("weights", t, ("tokens", K)), b.input("ids", INT32, ("tokens", K))
    gate_up, down = b.param("gate_up", t, (HELD * 2 * INTER, HIDDEN)), b.param("down", t, (HELD * HIDDEN, INTER))
    with pytest.raises(GraphError, match=r"E' of the 24 routed from first_expert 20 on; found f32\[240,24\]"):
        b.moe_experts(x, weights, ids, gate_up, down, experts=ROUTED, act="silu", first_expert=20)


def test_the_held_experts_kernels_compile_for_sm90(tmp_path):
    """The launches expert parallelism changes: the GEMVs, the sort and the sum (over the held experts' rows)."""
    from pegainfer.backends.build import compile_many

    spec = planned(held_graph("bf16"))
    changed = ("moe_gate_up_kernel", "moe_down_kernel", "moe_sort_kernel", "moe_sum_kernel")
    todo = {(90, f"{variant.name}/{launch.function}"): launch for variant in spec.variants[:2]
            for launch in variant.launches if launch.function in changed}
    assert len(todo) == 4
    for (_, key), compiled in compile_many(todo, 4, None):
        assert compiled.cubin[:4] == b"\x7fELF" and compiled.function.startswith(key.split("/")[1]), key
