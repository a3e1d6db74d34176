"""The collective ops' reference semantics over ranks run as threads (ir/ranks.py): each against the same exchange
done by hand in NumPy; a collective outside a rank group, a rank that fails, and wrong shapes refused."""

import numpy as np
import pytest

from pegainfer.errors import GraphError
from pegainfer.ir.builder import GraphBuilder
from pegainfer.ir.dtypes import FP32
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.ranks import run_ranks

WORLD = 4
RNG = np.random.default_rng(0)


def one_op_graph(op: str, shape: tuple, **attrs):
    b = GraphBuilder(op)
    x = b.input("x", FP32, shape)
    return b.finish(getattr(b, op)(x, world=WORLD, **attrs))


def run_each_rank(op: str, parts: list[np.ndarray], **attrs) -> list[np.ndarray]:
    """Every rank's result of `op`, rank r contributing parts[r] (an input of its own: a weight of one rank)."""
    b = GraphBuilder(op)
    x = b.param("x", FP32, parts[0].shape)
    graph = b.finish(getattr(b, op)(x, world=WORLD, **attrs))
    results = run_ranks([graph] * WORLD, {}, [{"x": p} for p in parts], [{}] * WORLD)
    return [r[0] for r in results]


def test_all_reduce_sums_every_rank_part_in_rank_order():
    parts = [RNG.standard_normal((3, 5)).astype(np.float32) for _ in range(WORLD)]
    expected = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    for result in run_each_rank("all_reduce", parts):
        np.testing.assert_array_equal(result, expected)  # the same bits on every rank


@pytest.mark.parametrize("axis", [0, -1])
def test_all_gather_concatenates_in_rank_order(axis):
    parts = [np.full((2, 3), r, np.float32) for r in range(WORLD)]
    for result in run_each_rank("all_gather", parts, axis=axis):
        np.testing.assert_array_equal(result, np.concatenate(parts, axis=axis))


def test_reduce_scatter_gives_each_rank_its_part_of_the_sum():
    parts = [RNG.standard_normal((2, 8)).astype(np.float32) for _ in range(WORLD)]
    total = sum(parts[1:], parts[0])
    for rank, result in enumerate(run_each_rank("reduce_scatter", parts, axis=-1)):
        np.testing.assert_allclose(result, total[:, 2 * rank:2 * rank + 2], rtol=1e-6)


def test_all_to_all_sends_part_j_of_every_rank_to_rank_j():
    parts = [np.arange(8, dtype=np.float32).reshape(8, 1) + 100 * r for r in range(WORLD)]
    for rank, result in enumerate(run_each_rank("all_to_all", parts)):
        expected = np.concatenate([parts[src][2 * rank:2 * rank + 2] for src in range(WORLD)])
        np.testing.assert_array_equal(result, expected)


def test_a_collective_outside_a_rank_group_is_an_error():
    graph = one_op_graph("all_reduce", (2, 2))
    with pytest.raises(GraphError, match="no rank group"):
        run_graph(graph, {"x": np.zeros((2, 2), np.float32)}, {}, {})


def test_a_failing_rank_fails_the_others_instead_of_hanging_them():
    b = GraphBuilder("g")
    x = b.param("x", FP32, (2, 2))
    graph = b.finish(b.all_reduce(x, world=2))
    with pytest.raises(KeyError):  # rank 1 lacks its weight: its error is the one raised, rank 0 is released
        run_ranks([graph, graph], {}, [{"x": np.zeros((2, 2), np.float32)}, {}], [{}, {}])


@pytest.mark.parametrize("op, shape, attrs, message", [
    ("all_reduce", (2, 2), {"world": 1}, "at least 2 ranks"),
    ("reduce_scatter", (2, 6), {"world": 4}, "divisible by 4 ranks"),
    ("all_gather", (2, 6), {"world": 2, "axis": 2}, "out of range"),
    ("all_to_all", (6, 2), {"world": 4}, "4 equal parts"),
])
def test_bad_collectives_are_refused(op, shape, attrs, message):
    b = GraphBuilder("g")
    x = b.input("x", FP32, shape)
    with pytest.raises(GraphError, match=message):
        getattr(b, op)(x, **attrs)
