"""The routed experts of one rank (passes/shard.py): each expert split inside (its intermediate rows, as a dense
MLP's), or with expert parallelism whole experts across the ranks, rank r holding experts [r E / w, (r + 1) E / w)
and the loader reading only theirs. Either way the router stays replicated (every rank holds every token), each
rank sums the pairs it can, and an all-reduce adds the ranks' sums."""

from typing import TYPE_CHECKING

from pegainfer.errors import GraphError
from pegainfer.ir.graph import Derivation, Node
from pegainfer.ir.ops.moe import held_experts

if TYPE_CHECKING:
    from pegainfer.passes.shard import Sharder


def shard_experts(sharder: "Sharder", node: Node) -> None:
    """A moe_experts node for this rank, by the experts' parallelism."""
    if sharder.parallel.expert_parallel:
        return _whole_experts(sharder, node)
    return _inside_experts(sharder, node)


def _whole_experts(sharder: "Sharder", node: Node) -> None:
    """This rank's experts whole, each stacked weight (and FP8 scale) re-derived from their tensors alone."""
    experts, world, rank = node.attrs["experts"], sharder.world, sharder.rank
    stacked = node.inputs[3:]
    if held_experts(sharder.declared[node.inputs[4]], sharder.declared[node.inputs[0]].shape[1]) != experts:
        raise GraphError(f"expert parallelism of %{node.name}: it holds some of its {experts} experts already")
    if experts % world:
        raise GraphError(f"expert parallelism over {world} ranks: {stacked[0]} stacks {experts} experts, which do "
                         f"not divide into {world} parts")
    per = experts // world
    for param in stacked:
        derivation = sharder.g.derived.get(param)
        if derivation is None or derivation.rows or derivation.axis or len(derivation.sources) % experts:
            raise GraphError(f"expert parallelism of %{node.name}: {param} is not stacked at load from each "
                             f"expert's tensors")
        each = len(derivation.sources) // experts
        mine = slice(rank * per * each, (rank + 1) * per * each)
        sharder.g.derived[param] = Derivation(derivation.sources[mine], derivation.source_types[mine])
        rows = sum(t.shape[0] for t in derivation.source_types[mine])
        sharder.weights.set_type(param, sharder.g.params[param].with_shape((rows, *sharder.g.params[param].shape[1:])))
    sharder.reduced(node, node.inputs, {**node.attrs, "first_expert": rank * per})


def _inside_experts(sharder: "Sharder", node: Node) -> None:
    """Every expert's intermediate rows split: gate/up by rows, down by columns, each expert's tensors sliced."""
    gate_up, down = node.inputs[3], node.inputs[4]
    derived = sharder.g.derived
    if len(node.inputs) > 5 or gate_up not in derived or down not in derived:
        raise GraphError(f"tensor parallelism of %{node.name}: experts over FP8 or unstacked weights are not "
                         f"implemented (expert parallelism moves FP8 experts whole)")
    world, rank = sharder.world, sharder.rank
    rows = derived[gate_up].source_types[0].shape[0]
    if rows % world:
        raise GraphError(f"tensor parallelism over {world} ranks: {derived[gate_up].sources[0]} has {rows} "
                         f"intermediate rows, which do not divide into {world} parts")
    size = rows // world
    start, stop = rank * size, (rank + 1) * size
    for param, axis in ((gate_up, 0), (down, 1)):
        derivation = derived[param]
        for source in derivation.sources:
            sharder.weights.slice(source, axis, start, stop)
        sliced = tuple(sharder.g.shards[s].type for s in derivation.sources)
        derived[param] = Derivation(derivation.sources, sliced, derivation.axis)
        shape = list(sharder.g.params[param].shape)
        shape[axis] = sum(t.shape[0] for t in sliced) if axis == 0 else size
        sharder.weights.set_type(param, sharder.g.params[param].with_shape(tuple(shape)))
    sharder.reduced(node, node.inputs)
