"""Which linears tensor parallelism splits by output rows: Megatron's pairing, found from the dataflow rather
than by name. Values joined by ops that work head by head or element by element form a region; a region whose
every exit is a linear (which then splits by input columns, its partial sums all-reduced) has its entry linears
split by rows. A region that reaches anything else (a router's top-k, a norm over a whole row, the step's
outputs) stays replicated."""

from dataclasses import dataclass, field

from pegainfer.ir.graph import KERNEL, REPEAT, Graph, Node
from pegainfer.ir.registry import ELEMENTWISE, get_op
from pegainfer.ir.types import TensorType
from pegainfer.passes.rewrite import consumers

HEAD_OPS = ("kv_write", "paged_attention")  # per kv head / per query head: split along heads as they are


@dataclass
class Region:
    values: set[str] = field(default_factory=set)
    entries: list[Node] = field(default_factory=list)  # linears whose output rows the ranks split
    blocker: str = ""  # why the region stays replicated ("" when it splits)


def column_parallel_regions(g: Graph) -> list[Region]:
    """The regions of `g`'s linears, in order of their first entry; a region splits when its blocker is empty."""
    types = g.value_types()
    producers = g.producers()
    parent: dict[str, str] = {}

    def find(v: str) -> str:
        while parent.setdefault(v, v) != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def union(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    for node in g.nodes:
        if splits_along_heads(node, types):
            activations = [v for v in (*node.inputs, *node.outputs) if v in producers and types[v].dtype.is_float]
            for v in activations[1:]:
                union(activations[0], v)
    regions: dict[str, Region] = {}
    for node in g.nodes:
        if node.op == "linear":
            region = regions.setdefault(find(node.outputs[0]), Region())
            region.entries.append(node)
    for value in producers:
        if find(value) in regions:
            regions[find(value)].values.add(value)
    readers = consumers(g)
    for region in regions.values():
        region.blocker = _blocker(g, region, readers, producers, types)
    return list(regions.values())


def splits_along_heads(node: Node, types: dict[str, TensorType]) -> bool:
    """An op that computes the same with its heads (or, element by element, its columns) split across ranks."""
    if node.op in (KERNEL, REPEAT):
        return False
    if node.op in HEAD_OPS:
        return True
    if node.op == "reshape":
        return {types[node.inputs[0]].rank, node.output_types[0].rank} <= {2, 3}
    if node.op in ("rms_norm", "rope"):  # over each head's dims, when the value is [tokens, heads, dims]
        return types[node.inputs[0]].rank == 3
    return get_op(node.op).category == ELEMENTWISE


def _blocker(g: Graph, region: Region, readers: dict[str, list[Node]], producers: dict[str, Node],
             types: dict[str, TensorType]) -> str:
    entries = {id(n) for n in region.entries}
    for value in sorted(region.values):
        if value in g.outputs:
            return f"%{value} is an output of {g.name}"
        producer = producers[value]
        if not splits_along_heads(producer, types) and id(producer) not in entries:
            return f"%{value} comes from %{producer.name} ({producer.op})"
        for reader in readers.get(value, []):
            if reader.op == "linear" and reader.inputs[0] == value:
                continue  # an exit: split by its input columns
            if not splits_along_heads(reader, types):
                return f"%{value} reaches %{reader.name} ({reader.op}), which has no split form"
    return ""
