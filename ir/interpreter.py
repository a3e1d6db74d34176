"""The reference interpreter: runs any graph, before or after passes, on the CPU with NumPy.

Float math is float32; each node's result is rounded to the dtype its type declares (bf16 through ml_dtypes), as
GPU storage would round it. States (the KV cache) stay in their storage dtype and are written in place.
It is the oracle every pass and kernel is checked against: correct, not fast.
"""

from typing import Mapping

import numpy as np

from pegainfer.errors import GraphError
from pegainfer.ir.dtypes import FP32
from pegainfer.ir.graph import KERNEL, REPEAT, Graph, Node, instantiate
from pegainfer.ir.kernel import in_place_outputs, inner_nodes
from pegainfer.ir.registry import get_op
from pegainfer.ir.types import TensorType


Trace = list[tuple[str, Node, int | None, dict[str, np.ndarray], list[np.ndarray]]]


def run_graph(graph: Graph, inputs: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray],
              states: Mapping[str, np.ndarray], trace: Trace | None = None) -> list[np.ndarray]:
    """Runs `graph` on named inputs; weights and states are looked up by their expanded (per-layer) names.
    With `trace`, every kernel node appends (graph name, node, layer, copies of its inputs, its outputs)."""
    return _run(graph, graph, [inputs[name] for name in _require(graph, inputs)], weights, states, None, trace)


def _require(graph: Graph, inputs: Mapping[str, np.ndarray]) -> list[str]:
    missing = [name for name in graph.inputs if name not in inputs]
    if missing:
        raise GraphError(f"graph {graph.name}: inputs {missing} not given")
    return list(graph.inputs)


def _run(root: Graph, graph: Graph, args: list[np.ndarray], weights: Mapping[str, np.ndarray],
         states: Mapping[str, np.ndarray], layer: int | None, trace: Trace | None) -> list[np.ndarray]:
    symbols: dict[str, int] = {}
    env: dict[str, np.ndarray] = {}
    for (name, type_), array in zip(graph.inputs.items(), args):
        env[name] = store(_checked(graph, name, type_, array, symbols), type_)
    for name, type_ in graph.params.items():
        env[name] = store(_checked(graph, name, type_, weights[_expand(name, layer)], symbols), type_)
    for name, type_ in graph.states.items():
        env[name] = _checked(graph, name, type_, states[_expand(name, layer)], symbols)
    for node in graph.nodes:
        values = [env[name] for name in node.inputs]
        if node.op == REPEAT:
            results = _repeat(root, root.subgraphs[node.attrs["body"]], node.attrs["count"], values, weights, states,
                              trace)
        else:
            seen = {name: np.copy(v) for name, v in zip(node.inputs, values)} if trace is not None else {}
            results = execute(node, values)
            if trace is not None and node.op == KERNEL:
                trace.append((graph.name, node, layer, seen, [np.copy(r) for r in results]))
        env.update(zip(node.outputs, results))
    return [env[name] for name in graph.outputs]


def execute(node: Node, values: list[np.ndarray], *, rounded: bool = True) -> list[np.ndarray]:
    """One node's results. A kernel runs its primitive nodes in float32 and rounds only what it writes out, as a
    fused GPU kernel would; values written in place (KV cache) are returned as they are."""
    if node.op == KERNEL:
        local = dict(zip(node.inputs, values))
        for inner in inner_nodes(node):
            local.update(zip(inner.outputs, execute(inner, [local[name] for name in inner.inputs], rounded=False)))
        produced = [local[name] for name in node.outputs]
    else:
        produced = get_op(node.op).reference(*values, **node.attrs)
        produced = list(produced) if isinstance(produced, tuple) else [produced]
    in_place = in_place_outputs(node)  # a state in its storage dtype stays as it is; an activation is rounded
    return [array if not rounded or name in in_place and array.dtype == type_.dtype.np_dtype else store(array, type_)
            for name, array, type_ in zip(node.outputs, produced, node.output_types)]


def _repeat(root: Graph, body: Graph, count: int, values: list[np.ndarray], weights: Mapping[str, np.ndarray],
            states: Mapping[str, np.ndarray], trace: Trace | None) -> list[np.ndarray]:
    carried, invariant = values[: len(body.outputs)], values[len(body.outputs):]
    for layer in range(count):
        carried = _run(root, body, [*carried, *invariant], weights, states, layer, trace)
    return carried


def store(array: np.ndarray, type_: TensorType) -> np.ndarray:
    """Rounds to the declared dtype's storage, then widens floats back to float32 for the next op's math."""
    if not type_.dtype.is_float:
        return np.asarray(array).astype(type_.dtype.np_dtype, copy=False)
    if type_.dtype == FP32:
        return np.asarray(array, dtype=np.float32)
    return np.asarray(array).astype(type_.dtype.np_dtype).astype(np.float32)


def _expand(name: str, layer: int | None) -> str:
    return name if layer is None else instantiate(name, layer)


def _checked(graph: Graph, name: str, type_: TensorType, array: np.ndarray, symbols: dict[str, int]) -> np.ndarray:
    """Checks rank and fixed dims, and binds each symbol to one size across the graph's inputs."""
    shape = np.shape(array)
    if len(shape) != type_.rank:
        raise GraphError(f"graph {graph.name}: {name} expects {type_}, given shape {list(shape)}")
    for dim, size in zip(type_.shape, shape):
        bound = dim if isinstance(dim, int) else symbols.setdefault(dim, size)
        if bound != size:
            raise GraphError(f"graph {graph.name}: {name} expects {type_} with "
                             f"{dim if isinstance(dim, int) else f'{dim}={bound}'}, given shape {list(shape)}")
    return array
