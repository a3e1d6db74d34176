"""The graph: nodes in topological order over named values (graph inputs, params, states, node outputs).

Params are weights, named as in the Hugging Face checkpoint. States are tensors that outlive a step (the KV cache).
A body graph run by a `repeat` node names its params and states with a `{layer}` placeholder, so a transformer
layer is declared once and instantiated per layer by the executor, not copied into the graph.
"""

from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from pegainfer.ir.types import TensorType

REPEAT = "repeat"
LAYER_PLACEHOLDER = "{layer}"


@dataclass
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    output_types: tuple[TensorType, ...]
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.outputs[0]


@dataclass
class Graph:
    name: str
    inputs: dict[str, TensorType] = field(default_factory=dict)
    params: dict[str, TensorType] = field(default_factory=dict)
    states: dict[str, TensorType] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    subgraphs: dict[str, "Graph"] = field(default_factory=dict)

    def value_types(self) -> dict[str, TensorType]:
        """Every value this graph defines, by name."""
        types = {**self.inputs, **self.params, **self.states}
        for node in self.nodes:
            types.update(zip(node.outputs, node.output_types))
        return types

    def producers(self) -> dict[str, Node]:
        return {out: node for node in self.nodes for out in node.outputs}

    def to_networkx(self) -> nx.DiGraph:
        """Nodes are value producers (node names, inputs, params, states); edges follow data."""
        dag = nx.DiGraph()
        for source in (*self.inputs, *self.params, *self.states):
            dag.add_node(source)
        producer_of = self.producers()
        for node in self.nodes:
            dag.add_node(node.name)
            for value in node.inputs:
                source = producer_of[value].name if value in producer_of else value
                dag.add_edge(source, node.name)
        return dag

    def all_graphs(self) -> list["Graph"]:
        """This graph and its bodies, bodies first."""
        return [*self.subgraphs.values(), self]

    def expanded_params(self) -> dict[str, TensorType]:
        """Every weight the graph reads, with `{layer}` replaced for each layer of each repeat."""
        return self._expand(lambda graph: graph.params)

    def expanded_states(self) -> dict[str, TensorType]:
        """Every state tensor (KV cache) the graph touches, one per layer of each repeat."""
        return self._expand(lambda graph: graph.states)

    def _expand(self, pick) -> dict[str, TensorType]:
        types = dict(pick(self))
        for node in self.nodes:
            if node.op == REPEAT:
                body = self.subgraphs[node.attrs["body"]]
                for layer in range(node.attrs["count"]):
                    types.update({instantiate(name, layer): t for name, t in pick(body).items()})
        return types

def instantiate(name: str, layer: int) -> str:
    return name.replace(LAYER_PLACEHOLDER, str(layer))
