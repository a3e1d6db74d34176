"""Layer 3 of correctness: every generated Triton kernel of a small random Qwen3, run under TRITON_INTERPRET on
the CPU, against its ops' reference on the inputs a real step gives it; then whole prefill and decode steps made
of generated kernels alone against the reference interpreter. In float32 and in bf16 (METHOD.md's tolerances)."""

import dataclasses

import numpy as np
import pytest
import torch

from pegainfer.backends.planning import PlanOptions, static_layout
from pegainfer.backends.triton.execute import InterpretedExecutor, launch_kernel, step_sizes, to_numpy, to_torch
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.ir import FP32, GraphBuilder
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.kernel import in_place_outputs
from pegainfer.ir.registry import get_op
from pegainfer.ir.step import TOP_LOGPROBS
from pegainfer.models import qwen3
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step
from pegainfer.runtime.kv_blocks import BlockAllocator
from random_models import BLOCK_SIZE, random_qwen3_config, random_weights

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}  # relative error in norm
# tokens each sequence adds per step; the last step decodes one sequence alone (the one-row GEMV variant)
STEPS = {"prefill": [5, 1, 9], "mixed": [1, 1, 3], "decode": [1, 1, 1], "single": [1]}


@dataclasses.dataclass
class Model:
    dtype: str
    config: qwen3.Config
    declared: object
    lowered: object
    specs: dict
    plain_attention: dict  # the attention kernels planned without the split-KV variant
    token_rows: dict  # the rope/KV-write kernels with only their prompt-chunk variant (past these steps' sizes)
    weights: dict


def with_row_stride(array: np.ndarray, stride: int | None) -> torch.Tensor:
    """`array` as a torch tensor whose leading dim steps `stride` elements (a view into a wider buffer), the layout
    a kernel compiled for that static stride expects."""
    tensor = to_torch(array)
    row = int(np.prod(array.shape[1:]))
    if stride is None or array.ndim < 2 or stride == row:
        return tensor
    base = torch.zeros((array.shape[0], stride), dtype=tensor.dtype)
    base[:, :row] = tensor.reshape(array.shape[0], row)
    return base[:, :row].view(array.shape)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request) -> Model:
    rng = np.random.default_rng(11)
    config = dataclasses.replace(random_qwen3_config(rng), torch_dtype=request.param, num_key_value_heads=2,
                                 num_attention_heads=4, head_dim=16, attention_bias=True)
    declared = qwen3.build_graph(config)
    lowered, _ = lower(declared)
    weights = {name: value.astype(t.dtype.np_dtype) for (name, t), value in
               zip(declared.checkpoint_params().items(), random_weights(declared, rng).values())}
    weights |= {n: np.concatenate([weights[s] for s in d.sources]) for n, d in lowered.derivations().items()}
    specs = {(g.name, n.name): plan_kernel(g, n, PlanOptions(block_size=BLOCK_SIZE))
             for g in lowered.all_graphs() for n in g.nodes if n.op == KERNEL}
    plain = {(g.name, n.name): plan_kernel(g, n, PlanOptions(block_size=BLOCK_SIZE, split_kv_max_batch=0))
             for g in lowered.all_graphs() for n in g.nodes if n.op == KERNEL and n.attrs["kind"] == "paged_attention"}
    token_rows = {key: dataclasses.replace(spec, variants=[dataclasses.replace(v, max_rows=None)
                                                           for v in spec.variants if v.name == "token_rows"])
                  for key, spec in specs.items() if any(v.name == "token_rows" for v in spec.variants)}
    assert token_rows, "the rope/KV-write kernel plans a prompt-chunk variant"
    return Model(request.param, config, declared, lowered, specs, plain, token_rows, weights)


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30))


def workload(model: Model, graph, run) -> list[list[np.ndarray]]:
    """The outputs of three steps (prefill, mixed decode + chunk, decode) of `run(inputs, states)`."""
    rng = np.random.default_rng(5)
    allocator = BlockAllocator(num_blocks=24, block_size=BLOCK_SIZE)
    sizes = {"num_blocks": 24, "block_size": BLOCK_SIZE}
    states = {n: np.zeros(t.concrete(sizes), t.dtype.np_dtype) for n, t in graph.expanded_states().items()}
    seqs = [Sequence(i, rng.integers(0, model.config.vocab_size, 16).tolist()) for i in range(3)]
    results = []
    for plan in STEPS.values():
        chunks = [Chunk(seq, n) for seq, n in zip(seqs, plan)]
        inputs = pack_step(chunks, allocator)
        rows = inputs[TOP_LOGPROBS].size  # the middle row asks no top logprobs: its largest alone is kept
        inputs[TOP_LOGPROBS] = np.resize(np.array([2, 0, 5], np.int32), rows)
        results.append(run(inputs, states))
        commit_step(chunks)
    return results


def test_every_generated_kernel_matches_its_reference(model):
    checked = set()

    def run(inputs, states):
        trace = []
        outputs = run_graph(model.lowered, inputs, model.weights, states, trace=trace)
        sizes = step_sizes(model.lowered, inputs, states)
        types = {g.name: g.value_types() for g in model.lowered.all_graphs()}
        layouts = {g.name: static_layout(g) for g in model.lowered.all_graphs()}
        for graph_name, node, layer, seen, expected in trace:
            if layer not in (None, 0):
                continue
            stored = {name: value.astype(types[graph_name][name].dtype.np_dtype) for name, value in seen.items()}
            inputs = {name: with_row_stride(value, layouts[graph_name][name][0]) for name, value in stored.items()}
            for specs in (model.specs, model.plain_attention, model.token_rows):
                if (graph_name, node.name) in specs:
                    got = launch_kernel(specs[(graph_name, node.name)], node, dict(inputs), sizes)
                    _compare(model, node, {n: to_numpy(t) for n, t in got.items()},
                             dict(zip(node.outputs, expected)), seen)
            checked.add(node.attrs["kind"])
        return outputs

    workload(model, model.lowered, run)
    assert checked == {k.kind for k in model.specs.values()}, "every kernel kind must have been checked"


def _compare(model: Model, node, got: dict, expected: dict, seen: dict) -> None:
    tolerance = TOLERANCE[model.dtype]
    written = in_place_outputs(node)
    for name, reference in expected.items():
        if name in written:  # a cache: compare the slots this step wrote; the rest must be untouched
            assert relative_error(got[name], reference.astype(np.float32)) < tolerance, f"{node.name}: {name}"
        elif any(n.op == "sample" and name in n.outputs for n in node.attrs["nodes"]):
            _compare_sample(node, name, got, seen)
        elif name.startswith("top_ids"):
            values = got[name.replace("top_ids", "top_values")]
            logits = got[next(n for n in node.outputs if n.startswith("logits"))]
            np.testing.assert_array_equal(got[name] < 0, reference < 0)  # the ranks a row leaves unranked
            kept = got[name] >= 0
            np.testing.assert_allclose(np.take_along_axis(logits, np.maximum(got[name], 0), axis=1)[kept],
                                       values[kept], rtol=1e-6)
            assert (values[~kept] == -np.inf).all()
            if model.dtype == "float32":
                np.testing.assert_array_equal(got[name], reference)
        elif name.startswith("top_values"):
            ranked = reference > -np.inf
            np.testing.assert_array_equal(got[name] > -np.inf, ranked)
            assert relative_error(got[name][ranked], reference[ranked]) < tolerance, f"{node.name}: {name}"
        else:
            assert not np.isnan(got[name]).any(), f"{node.name}: {name} has elements no launch wrote"
            assert relative_error(got[name], reference) < tolerance, f"{node.name} ({node.attrs['kind']}): {name}"


def _compare_sample(node, name: str, got: dict, seen: dict) -> None:
    """The drawn tokens are those the `sample` op draws from the logits the kernel wrote (whose bf16 rounding
    differs from the reference's now and then), masked and penalised as it drew, exactly; their logprobs to 1e-5."""
    nodes = {n.op: n for n in node.attrs["nodes"]}
    sample, mask, penalize = nodes["sample"], nodes["mask_tokens"], nodes["penalize_tokens"]
    masked = get_op("mask_tokens").reference(got[mask.inputs[0]], *(seen[v] for v in mask.inputs[1:]))
    penalized = get_op("penalize_tokens").reference(masked, *(seen[v] for v in penalize.inputs[1:]))
    tokens, logprobs = get_op("sample").reference(penalized, *(seen[v] for v in sample.inputs[1:7]), masked,
                                                  **sample.attrs)
    if name == sample.outputs[0]:
        np.testing.assert_array_equal(got[name], tokens)
    else:
        np.testing.assert_allclose(got[name], logprobs, atol=1e-5)


def test_steps_made_of_generated_kernels_match_the_reference(model):
    """Against the reference executor on the same kernel DAG, so that both round at the same points (the passes'
    own equivalence with the declared graph is test_passes' business)."""
    expected = workload(model, model.lowered, lambda inputs, states: run_graph(
        model.lowered, inputs, model.weights, states))
    executor = InterpretedExecutor(model.lowered, model.specs)
    got = workload(model, model.lowered, lambda inputs, states: executor.run(
        inputs, model.weights, {n: to_torch(s) for n, s in states.items()}))
    for step, ours, theirs in zip(STEPS, got, expected):
        assert relative_error(ours[0], theirs[0]) < TOLERANCE[model.dtype], f"{step} step logits"
        if model.dtype == "float32":
            assert (ours[0].argmax(-1) == theirs[0].argmax(-1)).all()


def test_generated_row_kernel_runs_a_generic_chain():
    b = GraphBuilder("chain")
    x, y = b.input("x", FP32, ("tokens", 6)), b.input("y", FP32, ("tokens", 6))
    w = b.param("w", FP32, (6,))
    h = b.rms_norm(b.mul(b.silu(x), y), w, eps=1e-5)
    graph = b.finish(b.mul(h, y))
    lowered, _ = lower(graph)
    (kernel,) = [n for n in lowered.nodes if n.op == KERNEL]
    spec = plan_kernel(lowered, kernel, PlanOptions())
    rng = np.random.default_rng(2)
    inputs = {"x": rng.standard_normal((5, 6)).astype(np.float32), "y": rng.standard_normal((5, 6)).astype(np.float32)}
    weights = {"w": rng.standard_normal(6).astype(np.float32)}
    env = {name: to_torch(a) for name, a in {**inputs, **weights}.items()}
    (got,) = launch_kernel(spec, kernel, env, {"tokens": 5}).values()
    (expected,) = run_graph(graph, inputs, weights, {})
    assert relative_error(to_numpy(got), expected) < 1e-6
    assert "def row_elementwise_reduce(" in spec.variants[0].launches[0].source


@pytest.mark.parametrize("width", [6, 2500])
def test_an_elementwise_row_kernel_splits_its_columns_over_programs(width):
    b = GraphBuilder("gated")
    gate, up = b.input("gate", FP32, ("tokens", width)), b.input("up", FP32, ("tokens", width))
    graph = b.finish(b.mul(b.silu(gate), up))
    lowered, _ = lower(graph)
    (kernel,) = [n for n in lowered.nodes if n.op == KERNEL]
    spec = plan_kernel(lowered, kernel, PlanOptions())
    (row,) = spec.variants[0].launches
    assert row.grid[1].size({"tokens": 3}) == -(-width // 1024)  # a program per 1024 columns, the last partial
    rng = np.random.default_rng(3)
    inputs = {name: rng.standard_normal((3, width)).astype(np.float32) for name in ("gate", "up")}
    (got,) = launch_kernel(spec, kernel, {n: to_torch(a) for n, a in inputs.items()}, {"tokens": 3}).values()
    (expected,) = run_graph(graph, inputs, {}, {})
    assert relative_error(to_numpy(got), expected) < 1e-6
