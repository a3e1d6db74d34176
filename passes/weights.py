"""Weight transforms, applied by the loader and recorded in the graph as derived params."""

import os

from pegainfer.ir.graph import Derivation, Graph, Node
from pegainfer.ir.types import TensorType
from pegainfer.passes.manager import PassLog
from pegainfer.passes.rewrite import consumers, for_each_graph, fresh_name


def merge_sibling_linears(graph: Graph, log: PassLog) -> Graph:
    """Merges linears that read the same input (Q/K/V, gate/up) into one GEMM over concatenated weights + a split
    (FP8 weights: their values and scales concatenated, under one dequantize)."""
    def rewrite(g: Graph) -> None:
        readers_of = consumers(g)
        producers = g.producers()
        for value, readers in list(readers_of.items()):
            groups: dict[tuple, list[Node]] = {}
            for node in readers:
                key = _merge_key(g, node, value, producers, readers_of)
                if key is not None:
                    groups.setdefault(key, []).append(node)  # with and without bias apart, FP8 by its blocks
            for group in groups.values():
                if len(group) > 1:
                    _merge(g, group, producers, log)
                elif len([n for n in readers if n.op == "linear"]) > 1:
                    log.note(f"{g.name}: %{group[0].name} left alone: its siblings differ in weights or bias")
    return for_each_graph(graph, rewrite)


def _merge_key(g: Graph, node: Node, value: str, producers: dict, readers: dict) -> tuple | None:
    """What a linear must share with its siblings to merge (None: it cannot): a bias or none, its attrs (an output
    dtype), and for a weight dequantized from FP8 params, read by it alone, the dequantize's attrs, where its rows
    fill whole scale blocks."""
    if node.op != "linear" or node.inputs[0] != value:
        return None
    params = list(node.inputs[2:])
    dequantize = producers.get(node.inputs[1])
    if dequantize is None:
        params.append(node.inputs[1])
    elif dequantize.op != "dequantize" or len(readers.get(node.inputs[1], [])) != 1 \
            or g.params.get(dequantize.inputs[0]) is None \
            or g.params[dequantize.inputs[0]].shape[0] % dequantize.attrs["block"][0]:
        return None
    else:
        params += dequantize.inputs
    if not all(p in g.params and p not in g.derived for p in params):
        return None
    return (len(node.inputs) == 3, repr(sorted(node.attrs.items())),
            None if dequantize is None else repr(sorted(dequantize.attrs.items())))


def _merge(g: Graph, group: list[Node], producers: dict, log: PassLog) -> None:
    sizes = tuple(node.output_types[0].shape[-1] for node in group)
    dequantizes = [producers.get(node.inputs[1]) for node in group]
    if dequantizes[0] is None:
        weight = _derive(g, [node.inputs[1] for node in group])
        before = []
    else:
        values = _derive(g, [d.inputs[0] for d in dequantizes])
        scales = _derive(g, [d.inputs[1] for d in dequantizes])
        weight = fresh_name(g, values + ".dequantized")
        t = dequantizes[0].output_types[0]
        before = [Node("dequantize", (values, scales), (weight,), (t.with_shape((sum(sizes), t.shape[1])),),
                       dict(dequantizes[0].attrs))]
        g.nodes = [n for n in g.nodes if n not in dequantizes]
    inputs = [group[0].inputs[0], weight]
    if len(group[0].inputs) == 3:
        inputs.append(_derive(g, [node.inputs[2] for node in group]))
    out_type = group[0].output_types[0]
    merged_type = out_type.with_shape((*out_type.shape[:-1], sum(sizes)))
    merged = fresh_name(g, "+".join(node.name for node in group))
    linear = Node("linear", tuple(inputs), (merged,), (merged_type,), dict(group[0].attrs))
    split = Node("split", (merged,), tuple(out for node in group for out in node.outputs),
                 tuple(node.output_types[0] for node in group), {"sizes": sizes})
    first = g.nodes.index(group[0])
    g.nodes = g.nodes[:first] + [*before, linear, split] + [n for n in g.nodes[first:] if n not in group]
    read = {v for node in g.nodes for v in node.inputs}
    stored = [v for d in dequantizes if d is not None for v in d.inputs]
    for source in [v for node in group for v in node.inputs[1:]] + stored:
        if source not in read:  # the merged weight replaces it (a tied weight read elsewhere stays)
            g.params.pop(source, None)
    log.note(f"{g.name}: merged {', '.join('%' + n.name for n in group)} into %{merged} over @{weight}")


def _derive(g: Graph, sources: list[str]) -> str:
    """Declares the concatenation (rows) of `sources` as a derived param named after them."""
    prefix = os.path.commonprefix(sources)
    prefix = prefix[: prefix.rfind(".") + 1]
    suffix = os.path.commonprefix([s[::-1] for s in sources])[::-1]
    suffix = suffix[suffix.find("."):] if "." in suffix else ""
    name = prefix + "+".join(s[len(prefix): len(s) - len(suffix)] for s in sources) + suffix
    types = [g.params[s] for s in sources]
    rows = sum(t.shape[0] for t in types)
    g.params[name] = TensorType(types[0].dtype, (rows, *types[0].shape[1:]))
    g.derived[name] = Derivation(tuple(sources), tuple(types), axis=0)
    return name
