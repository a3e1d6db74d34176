"""ir/dag.py: the passes' topological order (least index first among the ready nodes) and the verifier's cycle."""

from pegainfer.ir.dag import find_cycle, lexicographic_order


def test_lexicographic_order_takes_the_least_ready_node_first():
    names = ["a", "b", "c", "d", "e"]
    edges = [("d", "a"), ("b", "c"), ("e", "c"), ("d", "a")]  # a repeated edge counts once as a dependency
    index = {name: i for i, name in enumerate(names)}
    assert lexicographic_order(names, edges, index.__getitem__) == ["b", "d", "a", "e", "c"]
    assert lexicographic_order(names, [], index.__getitem__) == names


def test_a_cycle_has_no_order_and_is_reported_in_order():
    names = ["x", "a", "b", "c"]
    edges = [("x", "a"), ("a", "b"), ("b", "c"), ("c", "a")]
    assert lexicographic_order(names, edges, names.index) is None
    cycle = find_cycle(names, edges)
    assert sorted(cycle) == ["a", "b", "c"]
    assert all((cycle[i], cycle[(i + 1) % 3]) in edges for i in range(3))
    assert find_cycle(names, edges[:3]) == []
    assert find_cycle(["s"], [("s", "s")]) == ["s"]
