"""The MoE kernels under TRITON_INTERPRET at decode-step row counts past the whole-step tests' (17 and 40 rows, 16
experts top-4, as the GPU archs checkpoint), with every buffer they write starting as NaN: the f32 scratch between
the gate/up and down launches comes from the GPU executor's activation arena, never zeroed, so a kernel that read
an element it had not written, or relied on a zeroed accumulator, would show here as NaN or as a wrong row."""

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


@pytest.mark.parametrize("rows", [17, 40])
def test_moe_kernels_write_every_element_they_read(rows):
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
    assert set(spec.scratch) == {"moe.hidden"}
    env["moe.hidden"] = torch.full((rows, K * INTER), float("nan"), dtype=torch.float32)
    env["experts"] = torch.full((rows, HIDDEN), float("nan"), dtype=torch.bfloat16)
    for launch in pick_variant(spec, sizes).launches:
        _run_launch(launch, env, sizes)
    got = to_numpy(env["experts"])
    assert not np.isnan(to_numpy(env["moe.hidden"])).any(), "the gate/up launch leaves scratch unwritten"
    assert np.isfinite(got).all()
    assert relative_error(got, expected) < 1e-2
