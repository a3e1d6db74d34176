"""The grouped expert GEMMs of prefill-shaped moe_experts steps (backends/triton/kernels/moe_grouped.py) under
TRITON_INTERPRET, against ir/ops/moe.py's `_experts`, on routings chosen to be awkward: tokens spread unevenly,
several experts with no token, one expert with most of them, k of 1 and 6, sizes off the tile sizes. Every scratch
buffer starts as NaN or garbage, as the GPU arena leaves it, so a launch that read what it had not written shows.
Also: which variant a step's row count picks, that the scratch bounds the padded pairs, and the sm_90 cubins."""

import re

import numpy as np
import pytest
import torch

from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.spec import pick_variant
from pegainfer.backends.triton import moe
from pegainfer.backends.triton.execute import _run_launch, to_numpy, to_torch
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.ir import GraphBuilder, dtype_from_name
from pegainfer.ir.dtypes import INT32
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.ops.moe import _experts
from pegainfer.passes.pipeline import lower

# name: (dtype, rows, hidden, intermediate, experts, k, act, empty experts, the expert most tokens pick)
CASES = {
    "bf16_k6_silu": ("bf16", 80, 72, 40, 16, 6, "silu", (5, 9, 12, 13), 3),
    "f32_k1_gelu": ("f32", 100, 48, 136, 8, 1, "gelu_tanh", (0, 4, 6), 2),
    "bf16_k1_silu": ("bf16", 130, 40, 24, 12, 1, "silu", (1, 2, 7, 8, 11), 10),
    "f32_k6_gelu": ("f32", 70, 24, 72, 10, 6, "gelu_tanh", (3, 7), 0),
}
TOLERANCE = {"bf16": 1e-2, "f32": 1e-5}
TORCH = {"bf16": torch.bfloat16, "f32": torch.float32}


def experts_graph(dtype: str, hidden: int, inter: int, experts: int, k: int, act: str):
    b = GraphBuilder("experts")
    t = dtype_from_name(dtype)
    x = b.input("x", t, ("tokens", hidden))
    weights = b.input("weights", t, ("tokens", k))
    ids = b.input("ids", INT32, ("tokens", k))
    gate_up = b.param("gate_up", t, (experts * 2 * inter, hidden))
    down = b.param("down", t, (experts * hidden, inter))
    return b.finish(b.moe_experts(x, weights, ids, gate_up, down, experts=experts, act=act, name="experts"))


def skewed_routing(rng, rows: int, experts: int, k: int, empty: tuple, heavy: int) -> np.ndarray:
    """k distinct experts a token, none of `empty`; `heavy` is the first choice of about 70% of the tokens and the
    others are drawn with uneven odds."""
    allowed = np.array([e for e in range(experts) if e not in empty])
    odds = rng.random(len(allowed)) ** 3 + 0.02
    odds /= odds.sum()
    ids = np.zeros((rows, k), np.int32)
    for row in range(rows):
        first = [heavy] if rng.random() < 0.7 else []
        rest = [e for e in rng.choice(allowed, size=len(allowed), replace=False, p=odds) if e not in first]
        ids[row] = (first + rest)[:k]
    return ids


def case_inputs(case: str):
    dtype, rows, hidden, inter, experts, k, act, empty, heavy = CASES[case]
    rng = np.random.default_rng(len(case))
    np_dtype = dtype_from_name(dtype).np_dtype
    ids = skewed_routing(rng, rows, experts, k, empty, heavy)
    weights = rng.random((rows, k)) + 0.1
    inputs = {"x": rng.standard_normal((rows, hidden)).astype(np_dtype),
              "weights": (weights / weights.sum(-1, keepdims=True)).astype(np_dtype), "ids": ids}
    params = {"gate_up": (rng.standard_normal((experts * 2 * inter, hidden)) * 0.2).astype(np_dtype),
              "down": (rng.standard_normal((experts * hidden, inter)) * 0.2).astype(np_dtype)}
    return inputs, params


def planned(case: str):
    dtype, rows, hidden, inter, experts, k, act, _, _ = CASES[case]
    lowered, _ = lower(experts_graph(dtype, hidden, inter, experts, k, act))
    (node,) = [n for n in lowered.nodes if n.op == KERNEL]
    return node, plan_kernel(lowered, node, PlanOptions())


def run_variant(spec, variant, inputs, params, rows: int, garbage: int = 12345) -> dict[str, torch.Tensor]:
    """The variant's launches on scratch full of NaN (float) or `garbage` (int), the output full of NaN."""
    sizes = {"tokens": rows}
    env = {name: to_torch(a) for name, a in {**inputs, **params}.items()}
    for name, (dtype, shape) in spec.scratch.items():
        shape = [d if isinstance(d, int) else sizes[d] for d in shape]
        env[name] = torch.full(shape, garbage, dtype=torch.int32) if dtype == "i32" else \
            torch.full(shape, float("nan"), dtype=TORCH[dtype])
    out_dtype = torch.bfloat16 if inputs["x"].dtype != np.float32 else torch.float32
    env["experts"] = torch.full(inputs["x"].shape, float("nan"), dtype=out_dtype)
    for launch in variant.launches:
        _run_launch(launch, env, sizes)
    return env


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


@pytest.mark.parametrize("case", CASES)
def test_grouped_gemms_match_the_reference_on_skewed_routings(case):
    dtype, rows, hidden, inter, experts, k, act, empty, heavy = CASES[case]
    node, spec = planned(case)
    variant = pick_variant(spec, {"tokens": rows})
    assert variant.name == f"grouped_{moe.GROUPED_M}"
    inputs, params = case_inputs(case)
    as_f32 = {name: a.astype(np.float32) if a.dtype != np.int32 else a for name, a in {**inputs, **params}.items()}
    expected = _experts(as_f32["x"], as_f32["weights"], as_f32["ids"], as_f32["gate_up"], as_f32["down"],
                        experts=experts, act=act)
    env = run_variant(spec, variant, inputs, params, rows)
    got = to_numpy(env["experts"])
    assert np.isfinite(got).all(), "an output row left unwritten, or a NaN scratch element read"
    error = relative_error(got, expected)
    print(case, error)
    assert error < TOLERANCE[dtype]
    # the sort: each expert's pairs once, in pair order, padded with -1 to whole tiles; an empty expert, no tile
    counts = np.bincount(inputs["ids"].ravel(), minlength=experts)
    assert counts[heavy] > rows // 2 and not counts[list(empty)].any()
    tiles = to_numpy(env["moe.tiles"]).ravel()
    block = moe.GROUPED_M
    per_expert = -(-counts // block)
    assert tiles[0] == per_expert.sum()
    np.testing.assert_array_equal(tiles[1: 1 + tiles[0]], np.repeat(np.arange(experts), per_expert))
    pairs = to_numpy(env["moe.pairs"]).ravel()[: tiles[0] * block]
    for expert in range(experts):
        start = per_expert[:expert].sum() * block
        mine = pairs[start: start + per_expert[expert] * block]
        np.testing.assert_array_equal(mine[: counts[expert]], np.flatnonzero(inputs["ids"].ravel() == expert))
        assert (mine[counts[expert]:] == -1).all()


def test_grouped_and_gemv_variants_agree_and_the_grouped_one_is_deterministic():
    case = "bf16_k6_silu"
    rows = CASES[case][1]
    _, spec = planned(case)
    inputs, params = case_inputs(case)
    gemv, per_pair, grouped = spec.variants
    assert (gemv.max_rows, per_pair.max_rows, grouped.max_rows) == (moe.gemv_rows(6, 16), moe.GEMV_MAX_ROWS, None)
    first = to_numpy(run_variant(spec, grouped, inputs, params, rows)["experts"])
    again = to_numpy(run_variant(spec, grouped, inputs, params, rows, garbage=-3)["experts"])
    np.testing.assert_array_equal(first, again)
    # a program a pair or a few tiles a program: each tile's arithmetic is the same, so the sums are too (on the
    # first 20 rows: a program a pair is slow under the interpreter)
    few = {name: a[:20] for name, a in inputs.items()}
    np.testing.assert_array_equal(to_numpy(run_variant(spec, per_pair, few, params, 20)["experts"]),
                                  to_numpy(run_variant(spec, grouped, few, params, 20)["experts"]))
    assert relative_error(to_numpy(run_variant(spec, gemv, few, params, 20)["experts"]), first[:20]) < 1e-2


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 64, 65, 512, 4096])
def test_few_rows_take_the_gemv_variant_and_many_the_grouped_one(rows):
    """The GEMVs while pairs seldom share an expert (16 experts, k = 6: 1 row); the grouped GEMMs with a program a
    pair up to 64 rows, then a few tiles a program."""
    _, spec = planned("bf16_k6_silu")
    variant = pick_variant(spec, {"tokens": rows})
    assert variant.name == ("gemv_1" if rows <= 1 else "grouped_pairs" if rows <= 64 else f"grouped_{moe.GROUPED_M}")
    functions = [launch.function for launch in variant.launches]
    if rows <= 1:
        assert functions == ["moe_gate_up_kernel", "moe_down_kernel"]
        return
    assert functions == ["moe_sort_kernel", "moe_grouped_gate_up_kernel", "moe_grouped_down_kernel",
                         "moe_sum_kernel"]
    # the GEMMs' programs over the tiles (at most pairs / 64 + one an expert): one a pair, or 2 per 64 pairs
    programs = variant.launches[1].grid[1].size({"tokens": rows})
    assert programs == (rows * 6 if rows <= 64 else 2 * -(-rows * 6 // moe.GROUPED_M))


@pytest.mark.parametrize("k, experts", [(1, 8), (2, 64), (6, 16), (6, 64), (8, 128), (8, 256), (4, 512)])
def test_scratch_bounds_the_padded_pairs_of_every_grouped_step(k, experts):
    """At every row count the grouped variant serves, the worst routing's tiles (one pair alone in a tile for as
    many experts as can have one, the rest in whole tiles) fit moe.pairs padded, and moe.tiles with their count."""
    gemv_max = moe.gemv_rows(k, experts)
    block, slots = moe.GROUPED_M, moe.pair_slots(k, experts, gemv_max)
    for rows in range(gemv_max + 1, 5000, 7):
        pairs = rows * k
        alone = min(experts, pairs)
        tiles = alone + (pairs - alone) // block
        assert tiles * block <= rows * slots, (rows, k, experts)
        assert 1 + tiles <= rows * (k + 1)
        assert tiles * block <= pairs + experts * (block - 1)  # pair_slots' first bound


def test_both_variants_compile_for_sm90_the_grouped_gemms_on_the_tensor_cores(tmp_path):
    from pegainfer.backends.build import compile_many
    from test_native_backends import sass

    _, spec = planned("bf16_k6_silu")
    todo = {(90, f"{variant.name}/{launch.function}"): launch for variant in spec.variants
            for launch in variant.launches}
    assert len(todo) == 10
    for (sm, key), compiled in compile_many(todo, 4, None):
        assert compiled.cubin[:4] == b"\x7fELF" and compiled.function.startswith(key.split("/")[1]), key
        text = sass(compiled.cubin, tmp_path)
        if "moe_grouped_" in key:
            assert re.search(r"\bH[G]?MMA\b", text), f"{key}: no tensor-core instruction"
