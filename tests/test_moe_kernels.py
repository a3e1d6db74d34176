"""The MoE kernels under TRITON_INTERPRET. The experts' GEMV variant at decode-step row counts past the whole-step
tests' (17 and 40 rows, 16 experts top-4, as the GPU archs checkpoint), with every buffer they write starting as NaN:
the f32 scratch between the gate/up and down launches comes from the GPU executor's activation arena, never zeroed,
so a kernel that read an element it had not written, or relied on a zeroed accumulator, would show here as NaN or as
a wrong row. The routing kernel against ir/ops/moe.py's `_route` for every scoring, grouping and weighting it takes
(the grouped expert GEMMs: tests/test_moe_grouped.py)."""

import numpy as np
import pytest
import torch

from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.spec import pick_variant
from pegainfer.backends.triton.execute import _run_launch, launch_kernel, to_numpy, to_torch
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.ir import GraphBuilder, dtype_from_name
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.ops.moe import _route
from pegainfer.passes.pipeline import lower

HIDDEN, INTER, EXPERTS, K = 64, 32, 16, 4
BF16 = dtype_from_name("bf16")


def moe_graph():
    b = GraphBuilder("moe")
    x = b.input("x", BF16, ("tokens", HIDDEN))
    logits = b.input("logits", BF16, ("tokens", EXPERTS))
    weights, ids = b.moe_route(logits, k=K, normalize=True, name="route")
    gate_up = b.param("gate_up", BF16, (EXPERTS * 2 * INTER, HIDDEN))
    down = b.param("down", BF16, (EXPERTS * HIDDEN, INTER))
    return b.finish(b.moe_experts(x, weights, ids, gate_up, down, experts=EXPERTS, act="silu", name="experts"))


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


@pytest.mark.parametrize("rows", [1])  # the GEMVs' rows here (16 experts, k = 4); more take the grouped GEMMs,
def test_moe_kernels_write_every_element_they_read(rows):  # whose scratch test_moe_grouped poisons the same way
    graph = moe_graph()
    lowered, _ = lower(graph)
    route, experts = [n for n in lowered.nodes if n.op == KERNEL]
    rng = np.random.default_rng(rows)
    inputs = {"x": rng.standard_normal((rows, HIDDEN)), "logits": rng.standard_normal((rows, EXPERTS)) * 3}
    params = {"gate_up": rng.standard_normal((EXPERTS * 2 * INTER, HIDDEN)) * 0.2,
              "down": rng.standard_normal((EXPERTS * HIDDEN, INTER)) * 0.2}
    inputs = {name: a.astype(BF16.np_dtype) for name, a in inputs.items()}
    params = {name: a.astype(BF16.np_dtype) for name, a in params.items()}
    (expected,) = run_graph(graph, inputs, params, {})

    env = {name: to_torch(a) for name, a in {**inputs, **params}.items()}
    sizes = {"tokens": rows}
    env |= launch_kernel(plan_kernel(lowered, route, PlanOptions()), route, env, sizes)
    spec = plan_kernel(lowered, experts, PlanOptions())
    variant = pick_variant(spec, sizes)
    assert variant.name == "gemv_1"  # the per-pair GEMVs, over moe.hidden alone
    assert {p.buffer for launch in variant.launches for p in launch.params} & set(spec.scratch) == {"moe.hidden"}
    env["moe.hidden"] = torch.full((rows, K * INTER), float("nan"), dtype=torch.float32)
    env["experts"] = torch.full((rows, HIDDEN), float("nan"), dtype=torch.bfloat16)
    for launch in variant.launches:
        _run_launch(launch, env, sizes)
    got = to_numpy(env["experts"])
    assert not np.isnan(to_numpy(env["moe.hidden"])).any(), "the gate/up launch leaves scratch unwritten"
    assert np.isfinite(got).all()
    assert relative_error(got, expected) < 1e-2


F32 = dtype_from_name("f32")
ROUTE_ROWS = 9
# (experts, routing attributes, whether a score bias is added, logits quantised to 0.5 so that ties occur)
ROUTES = {
    "sigmoid_bias_top2_groups": (16, dict(k=8, normalize=True, scoring="sigmoid", groups=4, topk_group=2,
                                          group_score="top2", scale=2.5), True, False),
    "softmax_max_groups_12": (12, dict(k=4, normalize=False, groups=4, topk_group=2, group_score="max"), False, False),
    "sigmoid_bias_top2_12": (12, dict(k=6, normalize=True, scoring="sigmoid", groups=4, topk_group=3,
                                      group_score="top2", scale=1.5), True, False),
    "plain_softmax": (16, dict(k=4, normalize=True), False, False),
    "sigmoid_bias_ungrouped_10": (10, dict(k=8, normalize=False, scoring="sigmoid", scale=2.0), True, False),
    "one_expert_groups_top2": (8, dict(k=3, normalize=True, scoring="sigmoid", groups=8, topk_group=4,
                                       group_score="top2"), True, False),
    "softmax_ties": (16, dict(k=5, normalize=True, groups=4, topk_group=2, group_score="max"), False, True),
    "sigmoid_ties_top2": (12, dict(k=4, normalize=False, scoring="sigmoid", groups=4, topk_group=2,
                                   group_score="top2", scale=3.0), True, True),
}


def route_graph(experts: int, attrs: dict, bias: bool):
    b = GraphBuilder("route")
    logits = b.input("logits", F32, ("tokens", experts))
    extra = (b.param("bias", F32, (experts,)),) if bias else ()
    weights, ids = b.moe_route(logits, *extra, **attrs, name="route")
    return b.finish(weights, ids)


@pytest.mark.parametrize("case", ROUTES)
def test_route_kernel_chooses_and_weighs_as_the_reference(case):
    experts, attrs, with_bias, ties = ROUTES[case]
    rng = np.random.default_rng(len(case))
    logits = rng.standard_normal((ROUTE_ROWS, experts)).astype(np.float32) * 2
    bias = (rng.standard_normal(experts) * 0.3).astype(np.float32)
    if ties:  # equal logits (and a bias equal within pairs) give equal choices: the lower index must win
        logits, bias = np.round(logits * 2) / 2, np.repeat(bias[::2], 2)[:experts]
    lowered, _ = lower(route_graph(experts, attrs, with_bias))
    (route,) = [n for n in lowered.nodes if n.op == KERNEL]
    env = {"logits": to_torch(logits)} | ({"bias": to_torch(bias)} if with_bias else {})
    got = launch_kernel(plan_kernel(lowered, route, PlanOptions()), route, env, {"tokens": ROUTE_ROWS})
    weights, ids = (to_numpy(got[name]) for name in route.outputs)
    want_weights, want_ids = _route(logits, *([bias] if with_bias else []), **attrs)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-7)
    if attrs["normalize"]:
        np.testing.assert_allclose(weights.sum(-1), attrs.get("scale", 1.0), rtol=1e-5)
    plain = {name: value for name, value in attrs.items() if name not in ("groups", "topk_group", "group_score")}
    if attrs.get("groups", experts) < experts:  # the case exercises the grouping: a row's choice differs without it
        assert (_route(logits, *([bias] if with_bias else []), **plain)[1] != ids).any()
    if with_bias:  # and the bias: some row's choice differs without it
        assert (_route(logits, **attrs)[1] != ids).any()


def test_route_plan_takes_the_reference_defaults_for_absent_attributes():
    lowered, _ = lower(route_graph(16, dict(k=4, normalize=True), False))
    (route,) = [n for n in lowered.nodes if n.op == KERNEL]
    (variant,) = plan_kernel(lowered, route, PlanOptions()).variants
    constexprs = variant.launches[0].constexprs
    assert (constexprs["G"], constexprs["S"], constexprs["TOPK_GROUP"], constexprs["SCALE"]) == (1, 16, 1, 1.0)
    assert not (constexprs["SIGMOID"] or constexprs["GROUP_TOP2"] or constexprs["BIAS"])
