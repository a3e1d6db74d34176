"""Stable text form (one node a line, diffable) and DOT form of a graph."""

from typing import Any

from pegainfer.ir.graph import KERNEL, Graph, Node


def format_graph(graph: Graph) -> str:
    """Bodies first, then the graph that repeats them."""
    return "\n\n".join(_format_one(g) for g in graph.all_graphs()) + "\n"


def _format_one(graph: Graph) -> str:
    sigil = _sigils(graph)
    args = ", ".join(f"%{name}: {t}" for name, t in graph.inputs.items())
    lines = [f"graph {graph.name}({args}) {{"]
    lines += [f"  param @{name}: {t}{_derivation(graph, name)}" for name, t in graph.params.items()]
    lines += [f"  state ${name}: {t}" for name, t in graph.states.items()]
    for node in graph.nodes:
        lines.append("  " + format_node(node, sigil) + _buffers(graph, node))
        lines += ["    | " + format_node(inner, sigil) for inner in node.attrs.get("nodes", ())]
    lines.append("  return " + ", ".join(sigil(name) for name in graph.outputs))
    lines.append("}")
    return "\n".join(lines)


def format_node(node: Node, sigil=lambda name: f"%{name}") -> str:
    """One line; a kernel prints as kernel.<kind> (its primitive nodes follow, indented, in format_graph)."""
    outputs = ", ".join(f"%{name}" for name in node.outputs)
    inputs = ", ".join(sigil(name) for name in node.inputs)
    shown = {k: v for k, v in node.attrs.items() if k not in ("nodes", "kind")}
    attrs = " {" + ", ".join(f"{k}={_format_attr(v)}" for k, v in sorted(shown.items())) + "}" if shown else ""
    types = ", ".join(str(t) for t in node.output_types)
    op = f"{node.op}.{node.attrs['kind']}" if node.op == KERNEL else node.op
    return f"{outputs} = {op}({inputs}){attrs} : {types}"


def _derivation(graph: Graph, name: str) -> str:
    derivation = graph.derived.get(name)
    if name in graph.defaults:
        return f" = {graph.defaults[name]!r} where the checkpoint has none"
    if derivation is None:
        return ""
    if derivation.dequantize is not None:
        rows, cols, dtype = derivation.dequantize
        weight, scale = derivation.sources
        pieces = ", ".join(f"[{a}:{b}]" for _, a, b in derivation.rows)
        return f" = rows {pieces} of dequantize(@{weight}, @{scale}) {{block=[{rows}, {cols}], dtype={dtype}}}"
    if derivation.rows:
        return f" = concat({', '.join(f'@{s}[{a}:{b}]' for s, a, b in derivation.pieces())})"
    return f" = concat({', '.join('@' + s for s in derivation.sources)}, axis={derivation.axis})"


def _buffers(graph: Graph, node: Node) -> str:
    placed = [f"%{out}->{graph.buffers[out]}" for out in node.outputs if out in graph.buffers]
    return f"  # {', '.join(placed)}" if placed else ""


def _sigils(graph: Graph):
    def sigil(name: str) -> str:
        if name in graph.params:
            return f"@{name}"
        if name in graph.states:
            return f"${name}"
        return f"%{name}"
    return sigil


def _format_attr(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ",".join(_format_attr(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value.isidentifier() else repr(value)
    return str(value)


def to_dot(graph: Graph) -> str:
    """Nodes as boxes labelled with op and type; weights as grey ellipses; each body as a cluster."""
    lines = ["digraph pegainfer {", "  rankdir=TB;", "  node [fontname=Helvetica, fontsize=10];"]
    for index, g in enumerate(graph.all_graphs()):
        lines.append(f"  subgraph cluster_{index} {{")
        lines.append(f"    label={_quote(g.name)};")
        lines += _dot_body(g, prefix=f"g{index}_")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_body(graph: Graph, prefix: str) -> list[str]:
    lines = []
    producer = {out: node.name for node in graph.nodes for out in node.outputs}
    for name, t in graph.inputs.items():
        lines.append(f"    {_quote(prefix + name)} [shape=invhouse, label={_label(name, t)}];")
    for name, t in {**graph.params, **graph.states}.items():
        lines.append(f"    {_quote(prefix + name)} [shape=ellipse, color=grey, fontcolor=grey, label={_label(name, t)}];")
    for node in graph.nodes:
        types = ", ".join(str(t) for t in node.output_types)
        title = node.op
        if node.op == KERNEL:
            title = f"{node.attrs['kind']}\\n(" + " + ".join(n.op for n in node.attrs["nodes"]) + ")"
        lines.append(f"    {_quote(prefix + node.name)} [shape=box, label={_label(title, types)}];")
        for value in node.inputs:
            lines.append(f"    {_quote(prefix + producer.get(value, value))} -> {_quote(prefix + node.name)};")
    return lines


def _label(title: str, detail: object) -> str:
    return _quote(f"{title}\\n{detail}")


def _quote(text: str) -> str:
    return '"' + text.replace('"', '\\"') + '"'
