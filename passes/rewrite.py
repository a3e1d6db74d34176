"""Graph surgery shared by the passes: use lists, fresh names, and grouping nodes into a kernel."""

import re
from collections.abc import Callable, Sequence

from pegainfer.ir.dag import lexicographic_order
from pegainfer.ir.graph import KERNEL, Graph, Node
from pegainfer.ir.kernel import in_place_outputs, inner_nodes

_COPY = re.compile(r"(.*?)((?:\.\d+)?)")  # a builder name and its copy suffix: `q_proj.1` is (`q_proj`, `.1`)


def for_each_graph(graph: Graph, rewrite: Callable[[Graph], None]) -> Graph:
    """Applies an in-place rewrite to every body and to the top graph."""
    for g in graph.all_graphs():
        rewrite(g)
    return graph


def consumers(graph: Graph) -> dict[str, list[Node]]:
    """value -> the nodes that read it (graph outputs are not nodes: see `used_outside`)."""
    readers: dict[str, list[Node]] = {}
    for node in graph.nodes:
        for value in node.inputs:
            readers.setdefault(value, []).append(node)
    return readers


def only_reader(graph: Graph, value: str, readers: dict[str, list[Node]]) -> Node | None:
    """The single node reading `value`, if exactly one does and it is not a graph output."""
    found = readers.get(value, [])
    return found[0] if len(found) == 1 and value not in graph.outputs else None


def fresh_name(graph: Graph, hint: str) -> str:
    taken = set(graph.value_types())
    for node in graph.nodes:
        taken.update(out for inner in inner_nodes(node) for out in inner.outputs)
    name, suffix = hint, 1
    while name in taken:
        name, suffix = f"{hint}.{suffix}", suffix + 1
    return name


def fuse(graph: Graph, members: list[Node], kind: str, name: str | None = None) -> Node | None:
    """Replaces `members` (primitive nodes or kernels) by one kernel node of `kind`, called `name` (by default
    kernel_name's choice). Its outputs are the members' values read elsewhere, plus every in-place write. Returns
    None, leaving the graph as it was, when grouping would create a cycle (some outside node sits between two
    members)."""
    chosen = {id(n) for n in members}
    ordered = [n for n in graph.nodes if id(n) in chosen]
    inner = [i for n in ordered for i in (inner_nodes(n) if n.op == KERNEL else (n,))]
    produced = {out for n in inner for out in n.outputs}
    inputs = list(dict.fromkeys(v for n in inner for v in n.inputs if v not in produced))
    rest = [n for n in graph.nodes if id(n) not in chosen]
    read_outside = {v for n in rest for v in n.inputs} | set(graph.outputs)
    writes = {out for n in inner for out in in_place_outputs(n)}
    outputs = [out for n in inner for out in n.outputs if out in read_outside or out in writes]
    types = dict(zip((o for n in inner for o in n.outputs), (t for n in inner for t in n.output_types)))
    kernel = Node(KERNEL, tuple(inputs), tuple(outputs), tuple(types[o] for o in outputs),
                  kernel_attrs(graph, kind, inner, outputs, name, replaced=ordered))
    position = graph.nodes.index(ordered[-1]) - len(ordered) + 1
    candidate = rest[:position] + [kernel] + rest[position:]
    ordered_nodes = topological_order(candidate)
    if ordered_nodes is None:
        return None
    graph.nodes = ordered_nodes
    return kernel


def kernel_attrs(graph: Graph, kind: str, inner: list[Node], outputs: list[str], name: str | None = None,
                 replaced: Sequence[Node] = ()) -> dict:
    """A kernel's attrs. Its name (`name`, else kernel_name's, made unique in `graph` beside the `replaced` nodes
    it stands for) is recorded only where it is not the first output's, the name every other node goes by."""
    chosen = _claim(graph, name or kernel_name(inner, outputs), inner, replaced)
    return {"kind": kind, "nodes": tuple(inner), **({"name": chosen} if chosen != outputs[0] else {})}


def kernel_name(inner: list[Node], outputs: list[str]) -> str:
    """What a kernel computes: its GEMM's name where it has one (gemm_name), else its first output's (a
    multi-output op's `route#0` is `route`)."""
    linear = next((n for n in inner if n.op == "linear"), None)
    return gemm_name(linear.name) if linear is not None else outputs[0].removesuffix("#0")


def gemm_name(value: str) -> str:
    """A GEMM by its output: a merged one (`q_proj+k_proj+v_proj`, `gate.1+up.1`) by its parts' stems, `_proj`
    left out, run together when each is a letter (`qkv`), else joined by `_` (`gate_up.1`); the copy suffix
    (`.1`: the second layer of a body) kept."""
    parts = [_COPY.fullmatch(part).groups() for part in value.split("+")]
    copies = {copy for _, copy in parts}
    if len(parts) == 1 or len(copies) != 1:
        return value
    stems = [stem.removesuffix("_proj") for stem, _ in parts]
    return ("" if all(len(stem) == 1 for stem in stems) else "_").join(stems) + copies.pop()


def _claim(graph: Graph, hint: str, inner: list[Node], replaced: Sequence[Node]) -> str:
    """`hint`, or `hint.N` where a node other than the `replaced` ones, or a value not made inside, has it
    (dataflow and ordering key nodes by name)."""
    skip = {id(n) for n in replaced}
    taken = {*graph.inputs, *graph.params, *graph.states}
    for node in (n for n in graph.nodes if id(n) not in skip):
        taken.add(node.name)
        taken.update(out for part in (inner_nodes(node) or (node,)) for out in part.outputs)
    taken -= {out for node in inner for out in node.outputs}
    name, suffix = hint, 1
    while name in taken:
        name, suffix = f"{hint}.{suffix}", suffix + 1
    return name


def topological_order(nodes: list[Node]) -> list[Node] | None:
    """The nodes in a topological order as close as possible to the given one; None if they hold a cycle."""
    index = {node.name: i for i, node in enumerate(nodes)}
    producer = {out: node.name for node in nodes for out in node.outputs}
    edges = [(producer[v], node.name) for node in nodes for v in node.inputs if v in producer]
    order = lexicographic_order(list(index), edges, index.__getitem__)
    if order is None:
        return None
    by_name = {node.name: node for node in nodes}
    return [by_name[name] for name in order]


def primitive(node: Node, op: str | tuple[str, ...]) -> bool:
    return node.op == op if isinstance(op, str) else node.op in op
