"""Clean-up passes: dead code and common subexpressions."""

from pegainfer.ir.graph import KERNEL, REPEAT, Graph, Node
from pegainfer.ir.kernel import in_place_outputs
from pegainfer.passes.manager import PassLog
from pegainfer.passes.rewrite import for_each_graph


def eliminate_dead_code(graph: Graph, log: PassLog) -> Graph:
    """Removes nodes whose results nobody reads (in-place writes are kept), then params nothing reads."""
    def rewrite(g: Graph) -> None:
        live = set(g.outputs)
        kept: list[Node] = []
        for node in reversed(g.nodes):
            if in_place_outputs(node) or any(out in live for out in node.outputs):
                kept.append(node)
                live.update(node.inputs)
            else:
                log.note(f"{g.name}: removed %{node.name} ({node.op}), never read")
        g.nodes = kept[::-1]
        for name in [p for p in g.params if p not in live]:
            del g.params[name]
            g.derived.pop(name, None)
            g.defaults.pop(name, None)
            log.note(f"{g.name}: removed param @{name}, never read")
    return for_each_graph(graph, rewrite)


def eliminate_common_subexpressions(graph: Graph, log: PassLog) -> Graph:
    """Merges nodes that apply the same op with the same attributes to the same inputs (writes excluded)."""
    def rewrite(g: Graph) -> None:
        seen: dict[tuple, Node] = {}
        renamed: dict[str, str] = {}
        kept: list[Node] = []
        for node in g.nodes:
            node.inputs = tuple(renamed.get(v, v) for v in node.inputs)
            if node.op in (KERNEL, REPEAT) or in_place_outputs(node):
                kept.append(node)
                continue
            key = (node.op, node.inputs, repr(sorted(node.attrs.items())), node.output_types)
            if key in seen and not any(out in g.outputs for out in node.outputs):
                renamed.update(zip(node.outputs, seen[key].outputs))
                log.note(f"{g.name}: %{node.name} is %{seen[key].name}")
                continue
            seen.setdefault(key, node)
            kept.append(node)
        g.nodes = kept
    return for_each_graph(graph, rewrite)
