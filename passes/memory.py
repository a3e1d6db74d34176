"""Memory planning: activations share buffers by liveness. A body is planned once for every layer it runs, so
activation memory does not grow with depth; views share their source's buffer; in-place writes use the states."""

from dataclasses import dataclass, field
from math import prod

from pegainfer.errors import GraphError
from pegainfer.ir.graph import Graph
from pegainfer.ir.kernel import in_place_outputs, is_view
from pegainfer.ir.types import TensorType
from pegainfer.passes.manager import PassLog


@dataclass
class Buffer:
    name: str
    symbols: tuple[str, ...]  # the size is `bytes` times the product of these symbols
    bytes: int
    holders: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return "*".join([str(self.bytes), *self.symbols])


def plan_memory(graph: Graph, log: PassLog) -> Graph:
    """Assigns every activation a buffer, reusing one once the value it held is read for the last time."""
    for g in graph.all_graphs():
        buffers = _plan(g, carried=set(g.outputs) if g is not graph else set())
        check_buffers(g)
        values = sum(len(b.holders) for b in buffers)
        log.note(f"{g.name}: {values} activations in {len(buffers)} buffers: "
                 + ", ".join(f"{b.name} = {b.describe()} bytes" for b in buffers))
    return graph


def _plan(g: Graph, carried: set[str]) -> list[Buffer]:
    """A body's outputs are the next layer's inputs: each gets a buffer of its own (`carry` buffers), which the
    runtime keeps twice and alternates by layer, so no layer overwrites what it is still reading."""
    root = _alias_roots(g)
    last_use = _last_uses(g, root)
    carried = {root.get(v, v) for v in carried}  # an output written in place: its source's buffer is the carry
    buffers: list[Buffer] = []
    free: list[Buffer] = []
    live: dict[str, Buffer] = {}
    live_or_freed: dict[str, Buffer] = {}  # every value that got a buffer, and which
    types = g.value_types()
    for index, node in enumerate(g.nodes):
        for value in [v for v, end in last_use.items() if end < index and v in live]:
            if value not in carried:
                free.append(live.pop(value))
            del last_use[value]
        if is_view(node):
            continue
        writes = in_place_outputs(node)
        for out in node.outputs:
            if out in writes:
                continue
            buffer = _take([] if out in carried else free, buffers, types[out])
            if out in carried:
                buffer.name = f"carry{sum(b.name.startswith('carry') for b in buffers)}"
            buffer.holders.append(out)
            live[out] = live_or_freed[out] = buffer
    g.buffers = {value: live_or_freed[root[value]].name for value in root if root[value] in live_or_freed}
    return buffers


def _take(free: list[Buffer], buffers: list[Buffer], type_: TensorType) -> Buffer:
    symbols = tuple(sorted(type_.symbols))
    size = type_.dtype.itemsize * prod(d for d in type_.shape if isinstance(d, int))
    for buffer in free:
        if buffer.symbols == symbols:
            free.remove(buffer)
            buffer.bytes = max(buffer.bytes, size)
            return buffer
    buffer = Buffer(f"b{len(buffers)}", symbols, size)
    buffers.append(buffer)
    return buffer


def _alias_roots(g: Graph) -> dict[str, str]:
    """Each node output -> the value whose memory it is (itself, or a view's or in-place write's source, followed
    back)."""
    root: dict[str, str] = {}
    for node in g.nodes:
        writes = in_place_outputs(node)
        for out in node.outputs:
            source = node.inputs[0] if is_view(node) else writes.get(out)
            root[out] = out if source is None else root.get(source, source)
    return root


def _last_uses(g: Graph, root: dict[str, str]) -> dict[str, int]:
    """root value -> index of the last node reading it or a view of it; graph outputs live to the end."""
    last: dict[str, int] = {}
    for index, node in enumerate(g.nodes):
        for value in node.inputs:
            if value in root:
                last[root[value]] = index
    for value in g.outputs:
        if value in root:
            last[root[value]] = len(g.nodes)
    return last


def check_buffers(g: Graph) -> None:
    """Replays the plan: every value must still be in its buffer when a node reads it."""
    holder: dict[str, str] = {}
    root = _alias_roots(g)
    for node in g.nodes:
        for value in node.inputs:
            buffer = g.buffers.get(value)
            if buffer is not None and holder.get(buffer) != root[value]:
                raise GraphError(f"graph {g.name}, node %{node.name}: reads %{value} from {buffer}, which now "
                                 f"holds %{holder.get(buffer)}")
        if not is_view(node):
            holder.update({g.buffers[out]: root[out] for out in node.outputs if out in g.buffers})
    for value in g.outputs:
        buffer = g.buffers.get(value)
        if buffer is not None and holder.get(buffer) != root[value]:
            raise GraphError(f"graph {g.name}: output %{value} was overwritten in {buffer}")


def activation_bytes(g: Graph, bindings: dict[str, int]) -> int:
    """Bytes of the planned buffers for concrete symbol values."""
    sizes: dict[str, int] = {}
    types = g.value_types()
    for value, buffer in g.buffers.items():
        t = types[value]
        sizes[buffer] = max(sizes.get(buffer, 0), t.dtype.itemsize * prod(t.concrete(bindings)))
    return sum(sizes.values())


