"""The graph: nodes in topological order over named values (graph inputs, params, states, node outputs).

Params are weights, named as in the Hugging Face checkpoint. States are tensors that outlive a step (the KV cache).
A body graph run by a `repeat` node names its params and states with a `{layer}` placeholder, so a transformer
layer is declared once and instantiated per layer by the executor, not copied into the graph. A body that holds
several layers (a period of alternating layer kinds, see ir/layers.py) names them `{layer*P+O}`: repetition i
reads layer i*P+O.
"""

import re
from dataclasses import dataclass, field
from typing import Any

from pegainfer.ir.types import TensorType

REPEAT = "repeat"
KERNEL = "kernel"  # a fusion group: attrs "nodes" (the primitive nodes it runs as one launch), "kind", "name"
LAYER_PLACEHOLDER = "{layer}"
_PLACEHOLDER = re.compile(r"\{layer(?:\*(\d+))?(?:\+(\d+))?\}")


@dataclass(frozen=True)
class Derivation:
    """A weight the loader makes from checkpoint tensors (their concatenation along `axis`; or, with `rows`, the
    concatenation of row ranges (source index, start, stop) of them), recorded in the graph so that the mapping
    from Hugging Face names stays inspectable. With `dequantize` (block rows, block columns, dtype) the sources are
    an FP8 weight and its scales, dequantized (ir/ops/quantize.py) before its rows are taken."""
    sources: tuple[str, ...]
    source_types: tuple[TensorType, ...]
    axis: int = 0
    rows: tuple[tuple[int, int, int], ...] = ()
    dequantize: tuple[int, int, str] | None = None

    def pieces(self) -> list[tuple[str, int, int]]:
        """(source, first row, row after the last) of each piece in order (whole sources: axis 0 only)."""
        if self.rows:
            return [(self.sources[index], start, stop) for index, start, stop in self.rows]
        assert self.axis == 0, f"row pieces of a concatenation along axis {self.axis}"
        return [(source, 0, t.shape[0]) for source, t in zip(self.sources, self.source_types)]


@dataclass(frozen=True)
class Shard:
    """One rank's slice of a checkpoint tensor (passes/shard.py): [start, stop) along `axis` of the stored tensor
    of type `full`, then `pad` zeros along that axis (the last rank's part of a vocabulary the ranks do not
    divide)."""
    axis: int
    start: int
    stop: int
    full: TensorType
    pad: int = 0

    @property
    def type(self) -> TensorType:
        shape = list(self.full.shape)
        shape[self.axis] = self.stop - self.start + self.pad
        return self.full.with_shape(tuple(shape))


@dataclass
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    output_types: tuple[TensorType, ...]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """A node's first output; a kernel's own name when fusion gave it one (passes/rewrite.py: kernel_name)."""
        return self.attrs.get("name", self.outputs[0]) if self.op == KERNEL else self.outputs[0]


@dataclass
class Graph:
    name: str
    inputs: dict[str, TensorType] = field(default_factory=dict)
    params: dict[str, TensorType] = field(default_factory=dict)
    states: dict[str, TensorType] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    subgraphs: dict[str, "Graph"] = field(default_factory=dict)
    derived: dict[str, Derivation] = field(default_factory=dict)  # params made at load time
    defaults: dict[str, float] = field(default_factory=dict)  # params a checkpoint may lack: filled with this value
    buffers: dict[str, str] = field(default_factory=dict)  # value -> activation buffer, set by memory planning
    shards: dict[str, Shard] = field(default_factory=dict)  # checkpoint tensor -> this rank's slice of it

    def value_types(self) -> dict[str, TensorType]:
        """Every value this graph defines, by name."""
        types = {**self.inputs, **self.params, **self.states}
        for node in self.nodes:
            types.update(zip(node.outputs, node.output_types))
        return types

    def producers(self) -> dict[str, Node]:
        return {out: node for node in self.nodes for out in node.outputs}

    def dataflow(self) -> tuple[list[str], list[tuple[str, str]]]:
        """(value producers: inputs, params, states and node names; edges following data between them)."""
        producer_of = self.producers()
        names = list(dict.fromkeys([*self.inputs, *self.params, *self.states, *(n.name for n in self.nodes)]))
        edges = [(producer_of[value].name if value in producer_of else value, node.name)
                 for node in self.nodes for value in node.inputs]
        return names, edges

    def all_graphs(self) -> list["Graph"]:
        """This graph and its bodies, bodies first."""
        return [*self.subgraphs.values(), self]

    def expanded_params(self) -> dict[str, TensorType]:
        """Every weight the graph reads, with `{layer}` replaced for each layer of each repeat."""
        return self._expand(lambda graph: graph.params)

    def expanded_states(self) -> dict[str, TensorType]:
        """Every state tensor (KV cache) the graph touches, one per layer of each repeat."""
        return self._expand(lambda graph: graph.states)

    def checkpoint_params(self) -> dict[str, TensorType]:
        """The checkpoint tensors the graph needs: its params, with each derived one replaced by its sources."""
        needed: dict[str, TensorType] = {}
        for graph, layer in self.instances():
            for name, type_ in graph.params.items():
                derivation = graph.derived.get(name)
                pairs = zip(derivation.sources, derivation.source_types) if derivation else [(name, type_)]
                needed.update({_at(source, layer): t for source, t in pairs})
        return needed

    def checkpoint_shards(self) -> dict[str, Shard]:
        """This rank's slice of each sharded checkpoint tensor, by expanded name."""
        return {_at(name, layer): shard for graph, layer in self.instances() for name, shard in graph.shards.items()}

    def derivations(self) -> dict[str, Derivation]:
        """Derived params by expanded name, their sources expanded too."""
        return {_at(name, layer): Derivation(tuple(_at(s, layer) for s in d.sources), d.source_types, d.axis, d.rows,
                                             d.dequantize)
                for graph, layer in self.instances() for name, d in graph.derived.items()}

    def param_defaults(self) -> dict[str, float]:
        """Params a checkpoint may leave out, by expanded name, with the value each then holds everywhere."""
        return {_at(name, layer): value for graph, layer in self.instances() for name, value in graph.defaults.items()}

    def instances(self) -> list[tuple["Graph", int | None]]:
        """This graph once, and each repeated body once per layer."""
        instances: list[tuple[Graph, int | None]] = [(self, None)]
        for node in self.nodes:
            if node.op == REPEAT:
                body = self.subgraphs[node.attrs["body"]]
                instances += [(body, layer) for layer in range(node.attrs["count"])]
        return instances

    def _expand(self, pick) -> dict[str, TensorType]:
        return {_at(name, layer): t for graph, layer in self.instances() for name, t in pick(graph).items()}


def layer_placeholder(stride: int = 1, offset: int = 0) -> str:
    """`{layer}`, or `{layer*stride+offset}` for one layer of a body that holds `stride` layers."""
    if stride == 1 and offset == 0:
        return LAYER_PLACEHOLDER
    return "{layer" + (f"*{stride}" if stride != 1 else "") + (f"+{offset}" if offset else "") + "}"


def has_placeholder(name: str) -> bool:
    return _PLACEHOLDER.search(name) is not None


def instantiate(name: str, layer: int) -> str:
    return _PLACEHOLDER.sub(lambda m: str(layer * int(m.group(1) or 1) + int(m.group(2) or 0)), name)


def _at(name: str, layer: int | None) -> str:
    return name if layer is None else instantiate(name, layer)
