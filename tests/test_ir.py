"""The IR: builder type checks, the verifier's errors, the text and DOT printers, and the interpreter's repeat,
symbol binding and storage rounding."""

import dataclasses
import re

import ml_dtypes
import numpy as np
import pytest

from pegainfer.errors import GraphError
from pegainfer.ir import BF16, FP32, INT32, GraphBuilder, TensorType
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.printer import format_graph, to_dot
from pegainfer.ir.verify import verify


def small_graph(dtype=FP32) -> Graph:
    """x -> rms_norm -> linear -> add(x): the smallest graph with params, attrs and a shared input."""
    b = GraphBuilder("small")
    x = b.input("x", dtype, ("tokens", 4))
    h = b.rms_norm(x, b.param("norm.weight", dtype, (4,)), eps=1e-6, name="norm")
    h = b.linear(h, b.param("proj.weight", dtype, (4, 4)), name="proj")
    return b.finish(b.add(x, h, name="out"))


def layered_graph(count: int) -> Graph:
    """A body adding a per-layer weight, repeated `count` times."""
    body = GraphBuilder("body", body=True)
    x = body.input("x", FP32, ("tokens", 2))
    body_graph = body.finish(body.add(x, body.param("w.{layer}", FP32, ("tokens", 2)), name="plus"))
    b = GraphBuilder("top")
    x = b.input("x", FP32, ("tokens", 2))
    (out,) = b.repeat(body_graph, count, carried=[x], invariant=[])
    return b.finish(out)


def test_text_form_is_one_node_a_line_and_stable():
    text = format_graph(small_graph())
    assert text == format_graph(small_graph())
    assert text.splitlines() == [
        "graph small(%x: f32[tokens,4]) {",
        "  param @norm.weight: f32[4]",
        "  param @proj.weight: f32[4,4]",
        "  %norm = rms_norm(%x, @norm.weight) {eps=1e-06} : f32[tokens,4]",
        "  %proj = linear(%norm, @proj.weight) : f32[tokens,4]",
        "  %out = add(%x, %proj) : f32[tokens,4]",
        "  return %out",
        "}",
    ]


def test_dot_form_has_every_node_and_edge():
    dot = to_dot(small_graph())
    assert dot.startswith("digraph")
    for edge in ('"g0_x" -> "g0_norm"', '"g0_norm.weight" -> "g0_norm"', '"g0_norm" -> "g0_proj"',
                 '"g0_proj" -> "g0_out"', '"g0_x" -> "g0_out"'):
        assert edge in dot


def test_builder_rejects_wrong_shapes_naming_the_node():
    b = GraphBuilder("bad")
    x = b.input("x", FP32, ("tokens", 4))
    with pytest.raises(GraphError, match=r"node %q \(linear\).*in-features 5"):
        b.linear(x, b.param("w", FP32, (3, 5)), name="q")
    with pytest.raises(GraphError, match=r"cannot reshape f32\[tokens,4\] to \[tokens,3\]"):
        b.reshape(x, shape=("tokens", 3))
    with pytest.raises(AttributeError, match="no op of that name"):
        b.no_such_op(x)


def test_verifier_names_a_dangling_input():
    graph = small_graph()
    graph.nodes[1] = dataclasses.replace(graph.nodes[1], inputs=("ghost", "proj.weight"))
    with pytest.raises(GraphError, match=r"node %proj \(linear\): input 'ghost' is not defined anywhere"):
        verify(graph)


def test_verifier_finds_a_cycle():
    graph = small_graph()
    graph.nodes[0] = dataclasses.replace(graph.nodes[0], inputs=("out", "norm.weight"))
    with pytest.raises(GraphError, match="cycle through"):
        verify(graph)


def test_verifier_rejects_out_of_order_nodes_and_wrong_types():
    graph = small_graph()
    graph.nodes[0], graph.nodes[1] = graph.nodes[1], graph.nodes[0]
    with pytest.raises(GraphError, match=r"node %proj .*'norm' is used before the node that defines it"):
        verify(graph)
    graph = small_graph()
    graph.nodes[2] = dataclasses.replace(graph.nodes[2], output_types=(TensorType(BF16, ("tokens", 4)),))
    with pytest.raises(GraphError, match=r"node %out \(add\): recorded output types \(bf16\[tokens,4\]\) but the "
                                         r"op's rule gives \(f32\[tokens,4\]\)"):
        verify(graph)


def test_verifier_rejects_unknown_ops_and_in_place_writes_into_activations():
    graph = small_graph()
    graph.nodes.append(Node("frobnicate", ("out",), ("f",), (TensorType(FP32, ("tokens", 4)),)))
    with pytest.raises(GraphError, match="unknown op 'frobnicate'"):
        verify(graph)
    b = GraphBuilder("writes")
    cache = b.input("not_a_state", FP32, (2, 4, 1, 2))
    kv = b.input("kv", FP32, ("tokens", 1, 2))
    slots = b.input("slots", INT32, ("tokens",))
    b.kv_write(cache, cache, kv, kv, slots, name="write")
    with pytest.raises(GraphError, match="writes in place into 'not_a_state', which is not a state"):
        b.finish(kv)
    b = GraphBuilder("update")
    base, x = b.input("base", FP32, ("tokens", 4)), b.input("x", FP32, ("tokens", 4))
    tables = [b.state("a", FP32, (1, 2, 4)), b.state("b", FP32, (1, 4, 2)), b.state("scale", FP32, (1,))]
    updated = b.lora_add(base, x, *tables, b.input("slots", INT32, ("tokens",)), name="update")
    b.finish(updated)  # lora_add alone reads its base: written in place
    with pytest.raises(GraphError, match="writes in place into 'base', which is not a state and is read elsewhere"):
        b.finish(b.add(base, updated))


def test_layer_placeholder_only_inside_bodies():
    b = GraphBuilder("top")
    x = b.input("x", FP32, (2,))
    b.param("w.{layer}", FP32, (2,))
    with pytest.raises(GraphError, match=r"'w.\{layer\}' uses \{layer\} outside a repeated body"):
        b.finish(x)


def test_a_body_input_named_as_a_step_input_must_be_that_step_input():
    """Kernels read step inputs (positions, block tables, ...) before waiting for the kernel before them, so a
    body's input of such a name must be the model's own input, passed to every layer unchanged (an invariant)."""
    def build(bound_to: str, carried: bool = False) -> None:
        body = GraphBuilder("body", body=True)
        x = body.input("x", FP32, ("tokens", 2))
        if carried:  # positions carried from layer to layer: the body returns them
            positions = body.input("positions", INT32, ("tokens",))
            body_graph = body.finish(body.add(x, body.param("w.{layer}", FP32, ("tokens", 2)), name="plus"),
                                     positions)
        else:
            body.input("positions", INT32, ("tokens",))
            body_graph = body.finish(body.add(x, body.param("w.{layer}", FP32, ("tokens", 2)), name="plus"))
        b = GraphBuilder("top")
        x = b.input("x", FP32, ("tokens", 2))
        values = {"positions": b.input("positions", INT32, ("tokens",)),
                  "other_positions": b.input("other_positions", INT32, ("tokens",))}
        values["computed"] = b.add(values["positions"], values["positions"], name="computed")
        if carried:
            out, _ = b.repeat(body_graph, 2, carried=[x, values[bound_to]], invariant=[])
        else:
            (out,) = b.repeat(body_graph, 2, carried=[x], invariant=[values[bound_to]])
        b.finish(out)

    build("positions")
    for bound_to, carried, found in (("other_positions", False, "'other_positions'"), ("computed", False,
                                     "'computed'"), ("positions", True, "'positions' (carried)")):
        with pytest.raises(GraphError, match=re.escape(f"body input 'positions' is a step input's name, so it must "
                                                       f"be bound, as a layer invariant, to the graph's input "
                                                       f"'positions'; found {found}")):
            build(bound_to, carried)


def test_layer_placeholder_only_inside_bodies_also_beside_a_body():
    """The root's parameters may not name {layer} when the graph has bodies too (the check once skipped them)."""
    graph = layered_graph(2)
    graph.params["bad.{layer}"] = TensorType(FP32, (2,))
    with pytest.raises(GraphError, match=r"'bad.\{layer\}' uses \{layer\} outside a repeated body"):
        verify(graph)


def test_repeat_runs_the_body_once_per_layer_with_its_own_weights():
    graph = layered_graph(3)
    assert format_graph(graph).count("add(") == 1, "the body is declared once, not copied per layer"
    weights = {f"w.{i}": np.full((5, 2), 10.0 ** i, np.float32) for i in range(3)}
    (out,) = run_graph(graph, {"x": np.ones((5, 2), np.float32)}, weights, {})
    np.testing.assert_array_equal(out, np.full((5, 2), 112.0))
    assert sorted(graph.expanded_params()) == ["w.0", "w.1", "w.2"]


def test_interpreter_binds_symbols_consistently():
    graph = layered_graph(1)
    with pytest.raises(GraphError, match=r"w.\{layer\} expects f32\[tokens,2\] with tokens=5, given shape \[4, 2\]"):
        run_graph(graph, {"x": np.ones((5, 2), np.float32)}, {"w.0": np.ones((4, 2), np.float32)}, {})
    with pytest.raises(GraphError, match=r"inputs \['x'\] not given"):
        run_graph(graph, {}, {}, {})


def test_interpreter_rounds_each_result_to_its_storage_dtype():
    graph = small_graph(BF16)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    weights = {"norm.weight": np.ones(4, ml_dtypes.bfloat16),
               "proj.weight": rng.standard_normal((4, 4)).astype(ml_dtypes.bfloat16)}
    (out,) = run_graph(graph, {"x": x}, weights, {})
    assert np.array_equal(out, out.astype(ml_dtypes.bfloat16).astype(np.float32)), "outputs must be bf16 values"
    assert not np.array_equal(out, x + (x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6)) @
                              weights["proj.weight"].astype(np.float32).T)


@pytest.mark.parametrize("kinds", [["a"] * 7, ["s"] * 5 + ["f"] + ["s"] * 5 + ["f"] + ["s", "s"], ["f"] * 3 + ["s"] * 5,
                                   ["s", "f"] * 3, ["a", "b", "c"], ["x"]])
def test_layer_segments_cover_the_layers_in_order_with_repeating_periods(kinds):
    from pegainfer.ir.graph import instantiate, layer_placeholder
    from pegainfer.ir.layers import plan_segments
    segments = plan_segments(kinds)
    covered = []
    for segment in segments:
        assert segment.start == len(covered)
        for repetition in range(segment.count):
            for j in range(segment.period):
                index = int(instantiate(layer_placeholder(segment.period, segment.start + j), repetition))
                assert index == len(covered) and kinds[index] == kinds[segment.start + j]
                covered.append(index)
    assert covered == list(range(len(kinds)))
