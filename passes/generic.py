"""The generic fusion rule, so that a new architecture is fused without a pattern written for it: a chain of
elementwise ops and at most one row reduction over the same rows becomes one kernel."""

from pegainfer.ir.graph import KERNEL, REPEAT, Graph, Node
from pegainfer.ir.registry import ELEMENTWISE, ROW_REDUCTION, get_op
from pegainfer.passes.manager import PassLog
from pegainfer.passes.rewrite import for_each_graph, fuse


def fuse_elementwise_chains(graph: Graph, log: PassLog) -> Graph:
    """Groups each row-local op with the group of an input's producer, while the group holds one row reduction."""
    def rewrite(g: Graph) -> None:
        group_of: dict[str, list[Node]] = {}  # value -> the group that produces it
        groups: list[list[Node]] = []
        for node in g.nodes:
            if not _row_local(node):
                continue
            group = next((grp for grp in (group_of.get(v) for v in node.inputs)
                          if grp is not None and _can_join(grp, node)), None)
            if group is None:
                group = []
                groups.append(group)
            group.append(node)
            group_of.update(dict.fromkeys(node.outputs, group))
        for group in [grp for grp in groups if len(grp) > 1]:
            kind = "elementwise_reduce" if any(_is_reduction(n) for n in group) else "elementwise"
            if fuse(g, group, kind) is None:
                log.note(f"{g.name}: could not fuse {', '.join('%' + n.name for n in group)}: a node outside the "
                         f"group sits between its members")
    return for_each_graph(graph, rewrite)


def _row_local(node: Node) -> bool:
    return node.op not in (KERNEL, REPEAT) and get_op(node.op).category in (ELEMENTWISE, ROW_REDUCTION)


def _is_reduction(node: Node) -> bool:
    return get_op(node.op).category == ROW_REDUCTION


def _can_join(group: list[Node], node: Node) -> bool:
    rows = group[0].output_types[0].shape[:1]
    reductions = sum(map(_is_reduction, group)) + _is_reduction(node)
    return reductions <= 1 and all(t.shape[:1] == rows for t in node.output_types)
