"""GraphBuilder: how DAG files declare graphs. Each op call checks its type rule at once, so a DAG file that wires
a wrong shape fails where it is written, naming the node."""

from dataclasses import dataclass
from typing import Any, Callable

from pegainfer.errors import GraphError
from pegainfer.ir.dtypes import DType
from pegainfer.ir.graph import REPEAT, Derivation, Graph, Node
from pegainfer.ir.registry import OPS, infer_types
from pegainfer.ir.types import Dim, TensorType
from pegainfer.ir.verify import verify


@dataclass(frozen=True)
class Value:
    name: str
    type: TensorType

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.type.shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype


class GraphBuilder:
    """Appends nodes in program order, which is therefore a topological order.

    `b.rms_norm(x, w, eps=1e-6)` is `b.op("rms_norm", x, w, eps=1e-6)` for every registered op.
    """

    def __init__(self, name: str, *, body: bool = False) -> None:
        """`body=True` for a graph run by `repeat`, whose params and states may name `{layer}`."""
        self.graph = Graph(name)
        self._body = body
        self._taken: set[str] = set()

    def input(self, name: str, dtype: DType, shape: tuple[Dim, ...]) -> Value:
        return self._declare(self.graph.inputs, name, TensorType(dtype, tuple(shape)))

    def param(self, name: str, dtype: DType, shape: tuple[Dim, ...]) -> Value:
        """A weight, named as in the checkpoint; `{layer}` in a body's param name stands for the layer index."""
        return self._declare(self.graph.params, name, TensorType(dtype, tuple(shape)))

    def stacked_param(self, name: str, sources: list[str], dtype: DType, source_shape: tuple[int, ...]) -> Value:
        """A weight the loader makes by stacking checkpoint tensors of one shape along rows (a MoE layer's experts):
        the graph reads one tensor, the checkpoint keeps Hugging Face's names."""
        source_type = TensorType(dtype, tuple(source_shape))
        value = self.param(name, dtype, (len(sources) * source_shape[0], *source_shape[1:]))
        self.graph.derived[name] = Derivation(tuple(sources), (source_type,) * len(sources), axis=0)
        return value

    def row_ranges_param(self, name: str, source: str, dtype: DType, source_shape: tuple[int, ...],
                         rows: list[tuple[int, int]]) -> Value:
        """A weight the loader makes from row ranges of one checkpoint tensor, in the given order (a projection
        whose output heads the checkpoint interleaves, regrouped so that each part is contiguous)."""
        source_type = TensorType(dtype, tuple(source_shape))
        value = self.param(name, dtype, (sum(stop - start for start, stop in rows), *source_shape[1:]))
        self.graph.derived[name] = Derivation((source,), (source_type,), 0,
                                              tuple((0, start, stop) for start, stop in rows))
        return value

    def state(self, name: str, dtype: DType, shape: tuple[Dim, ...]) -> Value:
        """A tensor that outlives the step (a KV cache), updated in place by mutating ops."""
        return self._declare(self.graph.states, name, TensorType(dtype, tuple(shape)))

    def op(self, op: str, *inputs: Value, name: str | None = None, **attrs: Any) -> Any:
        attrs = {key: tuple(v) if isinstance(v, list) else v for key, v in attrs.items()}
        label = self._fresh(name or op)
        try:
            types = infer_types(op, [v.type for v in inputs], attrs)
        except (GraphError, TypeError) as error:
            raise GraphError(f"graph {self.graph.name}, node %{label} ({op}): {error}") from None
        return self._append(Node(op, tuple(v.name for v in inputs), self._output_names(label, len(types)),
                                 types, attrs))

    def repeat(self, body: Graph, count: int, carried: list[Value], invariant: list[Value],
               name: str = "layers", layers: int = 1) -> tuple[Value, ...]:
        """Runs `body` `count` times; its outputs feed the carried inputs of the next iteration. `layers`: the
        decoder layers one run of the body holds (recorded for reports when more than one)."""
        if body.name in self.graph.subgraphs:
            raise GraphError(f"graph {self.graph.name}: a body named {body.name!r} is already used")
        self.graph.subgraphs[body.name] = body
        label = self._fresh(name)
        types = tuple(v.type for v in carried)
        node = Node(REPEAT, tuple(v.name for v in [*carried, *invariant]), self._output_names(label, len(types)),
                    types, {"body": body.name, "count": count, **({"layers": layers} if layers > 1 else {})})
        result = self._append(node)
        return result if isinstance(result, tuple) else (result,)

    def finish(self, *outputs: Value) -> Graph:
        self.graph.outputs = [v.name for v in outputs]
        verify(self.graph, body=self._body)
        return self.graph

    def __getattr__(self, op: str) -> Callable[..., Any]:
        if op.startswith("_") or op not in OPS:
            raise AttributeError(f"GraphBuilder has no method {op!r} and no op of that name is registered")
        return lambda *inputs, **attrs: self.op(op, *inputs, **attrs)

    def _declare(self, table: dict[str, TensorType], name: str, type_: TensorType) -> Value:
        if name in self._taken:
            raise GraphError(f"graph {self.graph.name}: value {name!r} declared twice")
        self._taken.add(name)
        table[name] = type_
        return Value(name, type_)

    def _fresh(self, hint: str) -> str:
        name, suffix = hint, 1
        while name in self._taken or any(t.startswith(name + "#") for t in self._taken):
            name, suffix = f"{hint}.{suffix}", suffix + 1
        return name

    def _output_names(self, label: str, count: int) -> tuple[str, ...]:
        return (label,) if count == 1 else tuple(f"{label}#{i}" for i in range(count))

    def _append(self, node: Node) -> Value | tuple[Value, ...]:
        self._taken.update(node.outputs)
        self.graph.nodes.append(node)
        values = tuple(Value(n, t) for n, t in zip(node.outputs, node.output_types))
        return values[0] if len(values) == 1 else values
