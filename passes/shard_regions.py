"""Which linears tensor parallelism splits by output rows: Megatron's pairing, found from the dataflow rather
than by name. Values joined by ops that work head by head or element by element form a region; a region whose
every exit is a linear (which then splits by input columns, its partial sums all-reduced) has its entry linears
split by rows. A region that reaches anything else (a router's top-k, a norm over a whole row, the step's
outputs) stays replicated, as does one whose weights are not checkpoint tensors the loader can slice (an FP8
weight's dequantize)."""

from dataclasses import dataclass, field

from pegainfer.ir.graph import KERNEL, REPEAT, Graph, Node
from pegainfer.ir.registry import ELEMENTWISE, get_op
from pegainfer.ir.types import TensorType
from pegainfer.passes.rewrite import consumers

HEAD_OPS = ("kv_write", "paged_attention")  # per kv head / per query head: every activation split along heads
# ops of which some activations split by heads or channels and the rest are read whole: (inputs, outputs) split.
# Latent attention's cache is one head every query head reads; a recurrence's state is sliced by the sharder.
PER_HEAD_ARGS = {"mla_attention": ((0, 1), (0,)), "gated_delta_rule": ((0, 1, 2, 3, 4), (1,)),
                 "causal_conv1d": ((0,), (1,))}
BLOCK_SOURCES = ("linear", "causal_conv1d")  # what a [tokens, columns] split may cut: a linear's rows, in blocks


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
            activations = [v for v in split_values(node) if v in producers and types[v].dtype.is_float]
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
    if node.op in HEAD_OPS or node.op in PER_HEAD_ARGS:
        return True
    if node.op == "reshape":
        return {types[node.inputs[0]].rank, node.output_types[0].rank} <= {2, 3}
    if node.op in ("rms_norm", "rope"):  # over each head's dims, when the value is [tokens, heads, dims]
        return types[node.inputs[0]].rank == 3
    if node.op == "split":  # each head's dims in parts; or a linear's rows in blocks (q | gate), each split alike
        return types[node.inputs[0]].rank in (2, 3)
    return get_op(node.op).category == ELEMENTWISE


def split_values(node: Node) -> list[str]:
    """The inputs and outputs of a per-head op that the ranks split (the others are read whole)."""
    if node.op not in PER_HEAD_ARGS:
        return [*node.inputs, *node.outputs]
    inputs, outputs = PER_HEAD_ARGS[node.op]
    return [node.inputs[i] for i in inputs] + [node.outputs[i] for i in outputs]


def is_checkpoint_weight(g: Graph, name: str, derived_rows: bool = False) -> bool:
    """A weight the sharder can slice: a checkpoint param, or with `derived_rows` one made at load of rows of
    checkpoint params (sliced by rows only); never a value computed in the step (an FP8 weight's dequantize)."""
    if name not in g.params:
        return False
    derivation = g.derived.get(name)
    return derivation is None or (derived_rows and derivation.dequantize is None and derivation.axis == 0)


def _blocker(g: Graph, region: Region, readers: dict[str, list[Node]], producers: dict[str, Node],
             types: dict[str, TensorType]) -> str:
    """Why the region stays replicated ("" when it splits): a weight the ranks cannot slice, a value it takes
    from or gives to an op with no split form, or one the step returns."""
    entries = {id(n) for n in region.entries}
    for node in region.entries:
        weights = [w for w in node.inputs[1:] if not is_checkpoint_weight(g, w, derived_rows=True)]
        if weights:
            return f"%{node.name}'s weight %{weights[0]} is no checkpoint tensor to slice (an FP8 weight's dequantize)"
    for value in sorted(region.values):
        if value in g.outputs:
            return f"%{value} is an output of {g.name}"
        producer = producers[value]
        if not splits_along_heads(producer, types) and id(producer) not in entries:
            return f"%{value} comes from %{producer.name} ({producer.op})"
        for reader in readers.get(value, []):
            if reader.op == "linear" and reader.inputs[0] == value:
                if not all(is_checkpoint_weight(g, w) for w in reader.inputs[1:]):
                    return f"%{value} reaches %{reader.name}, whose weight is not a checkpoint tensor"
                continue  # an exit: split by its input columns
            if not splits_along_heads(reader, types):
                return f"%{value} reaches %{reader.name} ({reader.op}), which has no split form"
            why = _unsliceable(g, reader, producers, types)
            if why:
                return why
    return ""


def _unsliceable(g: Graph, node: Node, producers: dict[str, Node], types: dict[str, TensorType]) -> str:
    """Why a per-head op of the region could not be split after all ("" when it can): a weight it reads whole
    that the sharder cannot slice, or a split of columns that no linear laid out in blocks."""
    if node.op == "mla_attention" and not is_checkpoint_weight(g, node.inputs[3]):
        return f"%{node.name}'s kv_b %{node.inputs[3]} is made in the step (an FP8 weight's dequantize)"
    if node.op == "causal_conv1d":
        weight = producers.get(node.inputs[1])
        source = weight.inputs[0] if weight is not None and weight.op == "reshape" else node.inputs[1]
        if not is_checkpoint_weight(g, source):
            return f"%{node.name}'s taps %{node.inputs[1]} are no checkpoint tensor (or its reshape)"
    if node.op == "split" and types[node.inputs[0]].rank == 2:
        producer = producers.get(node.inputs[0])
        if producer is None or producer.op not in BLOCK_SOURCES:
            return f"%{node.name} splits columns of %{node.inputs[0]}, which no linear lays out in blocks"
    return ""
