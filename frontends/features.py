"""What a target model shows a hidden-state drafter (MTP heads, EAGLE-3 heads: runtime/drafters.py): one more
graph output, FEATURES, a row for every token of the step. `with_final_hidden` gives the final RMSNorm's output at
every token (what an MTP head reads); `with_layer_inputs` the residual stream entering some decoder layers, side by
side (what EAGLE-3 reads: the input of layers 2, L/2 and L-3 by default), the repeated body cut at those layers so
that the stream between them is a value of the graph."""

import copy
import re

from pegainfer.errors import ConfigError
from pegainfer.ir.graph import REPEAT, Derivation, Graph, Node, layer_placeholder
from pegainfer.ir.registry import infer_types

FEATURES = "features"
_PLACEHOLDER = re.compile(r"\{layer(?:\*(\d+))?(?:\+(\d+))?\}")


def with_final_hidden(graph: Graph) -> Graph:
    """The graph with FEATURES: the final norm of every token's last hidden state (the model's final norm runs on
    the sampled rows only)."""
    graph = copy.deepcopy(graph)
    producers = graph.producers()
    norm = next((n for n in graph.nodes if n.op == "rms_norm" and n.inputs[0] in producers
                 and producers[n.inputs[0]].op == "gather_rows"), None)
    if norm is None:
        raise ConfigError(f"{graph.name}: no final norm over the sampled rows to read the last hidden state from")
    every_token = producers[norm.inputs[0]].inputs[0]
    _append(graph, Node("rms_norm", (every_token, *norm.inputs[1:]), (FEATURES,), (), dict(norm.attrs)))
    return graph


def with_layer_inputs(graph: Graph, layers: list[int]) -> Graph:
    """The graph with FEATURES: the residual stream entering each of `layers` (indices of decoder layers),
    concatenated in that order."""
    graph = copy.deepcopy(graph)
    taps = [_cut_before(graph, layer) for layer in layers]
    _append(graph, Node("concat", tuple(taps), (FEATURES,), (), {}))
    return graph


def _append(graph: Graph, node: Node) -> None:
    types = graph.value_types()
    node.output_types = infer_types(node.op, [types[v] for v in node.inputs], node.attrs)
    graph.nodes.append(node)
    graph.outputs.append(node.outputs[0])


def _cut_before(graph: Graph, layer: int) -> str:
    """The value entering decoder layer `layer`: the repeat covering it cut there when the layer starts one of
    its runs (a run starting at the layer already has it as its input)."""
    first = 0
    for at, node in enumerate(graph.nodes):
        if node.op != REPEAT:
            continue
        period, count = node.attrs.get("layers", 1), node.attrs["count"]
        if first <= layer < first + period * count:
            if (layer - first) % period:
                raise ConfigError(f"{graph.name}: decoder layer {layer} is inside a body of {period} layers "
                                  f"(layers {first}..{first + period * count - 1}); its input is not a value to read")
            runs = (layer - first) // period
            if runs == 0:
                return node.inputs[0]
            return _split_repeat(graph, at, runs)
        first += period * count
    raise ConfigError(f"{graph.name}: it has {first} decoder layers, no layer {layer}")


def _split_repeat(graph: Graph, at: int, runs: int) -> str:
    """Replaces the repeat at `at` by one of its first `runs` runs and one of the rest (a copy of the body whose
    layer names count on from there); returns the stream between them."""
    node = graph.nodes[at]
    if len(node.outputs) != 1:
        raise ConfigError(f"{graph.name}: a body carrying {len(node.outputs)} values cannot be cut")
    body = graph.subgraphs[node.attrs["body"]]
    period, count = node.attrs.get("layers", 1), node.attrs["count"]
    rest = _shifted_body(body, runs * period, f"{body.name}_from{runs}")
    graph.subgraphs[rest.name] = rest
    between = f"{node.outputs[0]}.run{runs}"
    head = Node(REPEAT, node.inputs, (between, *node.outputs[1:]), node.output_types, {**node.attrs, "count": runs})
    tail = Node(REPEAT, (between, *node.inputs[1:]), node.outputs, node.output_types,
                {**node.attrs, "body": rest.name, "count": count - runs})
    graph.nodes[at:at + 1] = [head, tail]
    return between


def _shifted_body(body: Graph, layers: int, name: str) -> Graph:
    """A copy of `body` whose weight and cache names (those with a layer placeholder) start `layers` layers on."""
    shifted = copy.deepcopy(body)
    shifted.name = name

    def shift(text: str) -> str:
        return _PLACEHOLDER.sub(lambda m: layer_placeholder(int(m.group(1) or 1), int(m.group(2) or 0) + layers),
                                text)
    shifted.params = {shift(k): v for k, v in shifted.params.items()}
    shifted.states = {shift(k): v for k, v in shifted.states.items()}
    shifted.defaults = {shift(k): v for k, v in shifted.defaults.items()}
    shifted.shards = {shift(k): v for k, v in shifted.shards.items()}
    shifted.derived = {shift(k): Derivation(tuple(map(shift, d.sources)), d.source_types, d.axis, d.rows,
                                            d.dequantize) for k, d in shifted.derived.items()}
    for node in shifted.nodes:
        node.inputs = tuple(map(shift, node.inputs))
    return shifted
