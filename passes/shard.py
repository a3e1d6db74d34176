"""Tensor parallelism: the graph of one rank of `world`. Projections into heads and the MLP's gate/up split by
output rows (their regions found in passes/shard_regions.py), the projections out of them by input columns with
an all-reduce of their partial sums; the embedding and the LM head split the vocabulary (padded to a multiple of
the ranks; the logits all-gathered and the padding cut); KV heads fewer than the ranks are replicated, each rank
keeping the one its query heads read; MoE experts split inside (each expert's intermediate rows). Every rank's
weights are slices of the checkpoint's tensors, recorded in `Graph.shards` for the loader."""

from dataclasses import dataclass
from math import prod

from pegainfer.errors import GraphError
from pegainfer.ir.graph import Graph, Node, Shard
from pegainfer.ir.registry import infer_types
from pegainfer.ir.types import TensorType
from pegainfer.passes.manager import Pass, PassLog
from pegainfer.passes.rewrite import fresh_name
from pegainfer.passes.shard_regions import column_parallel_regions, splits_along_heads


@dataclass(frozen=True)
class Parallelism:
    """Where one rank's graph runs: rank `rank` of `world`, experts split across the ranks whole
    (`expert_parallel`, vLLM's --enable-expert-parallel) or each split inside."""
    world: int = 1
    rank: int = 0
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        assert self.world >= 1 and 0 <= self.rank < self.world, f"rank {self.rank} of {self.world}"

    @property
    def sharded(self) -> bool:
        return self.world > 1


@dataclass(frozen=True)
class Split:
    """A value of which this rank holds [start, stop) of `full` along `dim`."""
    dim: int
    start: int
    stop: int
    full: int

    @property
    def partition(self) -> bool:
        return self.stop - self.start < self.full


def tensor_parallel(parallel: Parallelism) -> Pass:
    """The sharding pass for one rank."""
    assert parallel.sharded, f"sharding for one rank: {parallel}"
    world, rank = parallel.world, parallel.rank

    def shard_tensor_parallel(graph: Graph, log: PassLog) -> Graph:
        """Splits the graph for one rank (tensor parallelism): heads and MLP rows, all-reduces after the
        projections out of them, the vocabulary of the embedding and LM head."""
        for g in graph.all_graphs():
            _Sharder(g, world, rank, log, root=g is graph).run()
        log.note(f"rank {rank} of {world}")
        return graph
    return Pass("shard_tensor_parallel", "sharding", shard_tensor_parallel)


def vocab_part(vocab: int, world: int, rank: int, what: str) -> tuple[int, int, int]:
    """(first id, id after the last, padding rows) of this rank's part of a vocabulary: ceil(vocab / world) each."""
    if vocab < world:
        raise GraphError(f"tensor parallelism over {world} ranks: {what} has {vocab} rows, fewer than the ranks")
    per = -(-vocab // world)
    start = min(rank * per, vocab)
    stop = min(start + per, vocab)
    return start, stop, per - (stop - start)


def _partition(units: int, world: int, rank: int, what: str) -> tuple[int, int]:
    """(parts, this rank's part) of `units` heads or rows: `world` parts, or fewer with ranks sharing a part
    (KV heads fewer than the ranks)."""
    if units % world == 0:
        return world, rank
    if world % units == 0:
        return units, rank * units // world
    raise GraphError(f"tensor parallelism over {world} ranks: {what} has {units} heads or rows, which neither "
                     f"divide into {world} parts nor are a divisor of {world}")


class _Sharder:
    def __init__(self, g: Graph, world: int, rank: int, log: PassLog, root: bool) -> None:
        self.g, self.world, self.rank, self.log, self.root = g, world, rank, log, root
        self.types = g.value_types()  # this rank's types, updated as values are split
        self.declared = dict(self.types)  # the unsharded types
        self.layout: dict[str, Split] = {}
        self.nodes: list[Node] = []
        self.columns: set[str] = set()
        for region in column_parallel_regions(g):
            if region.blocker:
                names = ", ".join(f"%{n.name}" for n in region.entries)
                self.log.note(f"{g.name}: {names} replicated: {region.blocker}")
            else:
                self.columns.update(n.name for n in region.entries)

    def run(self) -> None:
        for node in self.g.nodes:
            self._visit(node)
        self.g.nodes = self.nodes
        split = [v for v in self.g.outputs if v in self.layout]
        if split:
            raise GraphError(f"tensor parallelism: {self.g.name} returns %{split[0]}, which is split across ranks")
        read = {v for node in self.nodes for v in node.inputs}
        for name in [p for p in self.g.params if p not in read]:  # a row-parallel bias only rank 0 adds
            self.g.params.pop(name)
            self.g.shards.pop(name, None)

    def _visit(self, node: Node) -> None:
        splits = [self.layout.get(v) for v in node.inputs]
        if node.op == "embedding":
            return self._embedding(node)
        if node.op == "linear" and splits[0] is not None:
            return self._row_parallel(node, splits[0])
        if node.op == "linear" and self.root and node.outputs[0] in self.g.outputs:
            return self._vocab_head(node)
        if node.op == "linear" and node.name in self.columns:
            return self._column_parallel(node)
        if node.op == "moe_experts" and not any(splits):
            return self._experts(node)
        if not any(splits):
            return self.nodes.append(node)
        if node.op == "reshape":
            return self._reshape(node, splits[0])
        if node.op == "kv_write":
            return self._kv_write(node, splits)
        if node.op == "paged_attention":
            return self._attention(node, splits)
        if splits_along_heads(node, self.declared) or node.op == "gather_rows":
            return self._pointwise(node, splits)
        raise GraphError(f"tensor parallelism: %{node.name} ({node.op}) reads a value split across ranks and has "
                         f"no split form")

    # --- weights -------------------------------------------------------------------------------------------------

    def _slice(self, name: str, axis: int, start: int, stop: int, pad: int = 0) -> None:
        """Declares this rank's slice of checkpoint tensor `name` (a param, or a source of a derived one)."""
        full = self.g.shards[name].full if name in self.g.shards else self._full_type(name)
        shard = Shard(axis, start, stop, full, pad)
        if self.g.shards.get(name, shard) != shard:
            raise GraphError(f"tensor parallelism: {name} is read split two ways ({self.g.shards[name]} and {shard})")
        self.g.shards[name] = shard
        if name in self.g.params:
            self.g.params[name] = self.types[name] = shard.type

    def _full_type(self, name: str) -> TensorType:
        if name in self.g.params:
            return self.g.params[name]
        for derivation in self.g.derived.values():
            if name in derivation.sources:
                return derivation.source_types[derivation.sources.index(name)]
        raise AssertionError(f"{name} is no param of {self.g.name}")

    def _weight(self, node: Node) -> str:
        weight = node.inputs[1]
        if weight not in self.g.params or weight in self.g.derived:
            raise GraphError(f"tensor parallelism of %{node.name} over {weight}, a weight made at load or in the "
                             f"step (an FP8 one's dequantize), is not implemented")
        return weight

    # --- ops -----------------------------------------------------------------------------------------------------

    def _emit(self, node: Node, inputs: tuple[str, ...], attrs: dict | None = None,
              outputs: tuple[str, ...] | None = None) -> Node:
        attrs = dict(node.attrs if attrs is None else attrs)
        types = infer_types(node.op, [self.types[v] for v in inputs], attrs)
        out = Node(node.op, inputs, outputs or node.outputs, types, attrs)
        self.types.update(zip(out.outputs, types))
        self.nodes.append(out)
        return out

    def _reduced(self, node: Node, inputs: tuple[str, ...], attrs: dict | None = None,
                 op: str = "all_reduce", **collective: int) -> None:
        """`node` over this rank's inputs into a fresh value, then a collective into node's output."""
        partial = fresh_name(self.g, node.outputs[0] + (".partial" if op == "all_reduce" else ".shard"))
        self._emit(node, inputs, attrs, outputs=(partial,))
        self._emit(Node(op, (), (node.outputs[0],), ()), (partial,), {"world": self.world, **collective})

    def _embedding(self, node: Node) -> None:
        table = node.inputs[1]
        start, stop, pad = vocab_part(self.declared[table].shape[0], self.world, self.rank, table)
        self._slice(table, 0, start, stop, pad)
        self._reduced(node, node.inputs, {**node.attrs, "first_id": start})

    def _vocab_head(self, node: Node) -> None:
        weight = self._weight(node)
        vocab = self.declared[weight].shape[0]
        start, stop, pad = vocab_part(vocab, self.world, self.rank, weight)
        self._slice(weight, 0, start, stop, pad)
        padded = (stop - start + pad) * self.world
        if padded == vocab:
            return self._reduced(node, node.inputs, op="all_gather", axis=-1)
        logits = node.outputs[0]
        gathered = fresh_name(self.g, logits + ".padded")
        self._reduced(Node(node.op, node.inputs, (gathered,), node.output_types, node.attrs), node.inputs,
                      op="all_gather", axis=-1)
        padding = fresh_name(self.g, logits + ".padding")
        self._emit(Node("split", (), (logits, padding), ()), (gathered,), {"sizes": (vocab, padded - vocab)})

    def _column_parallel(self, node: Node) -> None:
        weight = self._weight(node)
        rows = self.declared[weight].shape[0]
        heads = self._heads_of(node.outputs[0]) or rows
        parts, part = _partition(heads, self.world, self.rank, weight)
        size = rows // parts
        for param in node.inputs[1:]:
            self._slice(param, 0, part * size, (part + 1) * size)
        out = self._emit(node, node.inputs)
        self.layout[node.outputs[0]] = Split(out.output_types[0].rank - 1, part * size, (part + 1) * size, rows)

    def _heads_of(self, value: str) -> int:
        """The heads a linear's output is reshaped into (0: none), which its split must not cut."""
        for reader in self.g.nodes:
            if reader.op == "reshape" and reader.inputs[0] == value and reader.output_types[0].rank == 3:
                return reader.output_types[0].shape[1]
        return 0

    def _row_parallel(self, node: Node, split: Split) -> None:
        weight = self._weight(node)
        if split.dim != self.types[node.inputs[0]].rank - 1 or (split.stop - split.start) * self.world != split.full:
            raise GraphError(f"tensor parallelism: %{node.name} would sum parts of its input that ranks share "
                             f"(its input holds {split.start}:{split.stop} of {split.full} on this rank)")
        self._slice(weight, 1, split.start, split.stop)
        bias = node.inputs[2:] if self.rank == 0 else ()  # added once, by rank 0
        self._reduced(node, (node.inputs[0], weight, *bias))

    def _experts(self, node: Node) -> None:
        gate_up, down = node.inputs[3], node.inputs[4]
        if len(node.inputs) > 5 or gate_up not in self.g.derived or down not in self.g.derived:
            raise GraphError(f"tensor parallelism of %{node.name}: experts over FP8 or unstacked weights are not "
                             f"implemented")
        rows = self.g.derived[gate_up].source_types[0].shape[0]
        if rows % self.world:
            raise GraphError(f"tensor parallelism over {self.world} ranks: {self.g.derived[gate_up].sources[0]} has "
                             f"{rows} intermediate rows, which do not divide into {self.world} parts")
        size = rows // self.world
        start, stop = self.rank * size, (self.rank + 1) * size
        for param, axis in ((gate_up, 0), (down, 1)):
            derivation = self.g.derived[param]
            for source in derivation.sources:
                self._slice(source, axis, start, stop)
            sliced = tuple(self.g.shards[s].type for s in derivation.sources)
            self.g.derived[param] = type(derivation)(derivation.sources, sliced, derivation.axis)
            shape = list(self.g.params[param].shape)
            shape[axis] = sum(t.shape[0] for t in sliced) if axis == 0 else size
            self.g.params[param] = self.types[param] = self.g.params[param].with_shape(tuple(shape))
        self._reduced(node, node.inputs)

    def _reshape(self, node: Node, split: Split) -> None:
        before, after = self.declared[node.inputs[0]].shape, node.output_types[0].shape
        inner_in, inner_out = prod(before[2:]), prod(after[2:])
        first, last = split.start * inner_in, split.stop * inner_in
        if split.dim != 1 or first % inner_out or last % inner_out:
            raise GraphError(f"tensor parallelism: %{node.name} reshapes {before} to {after}, cutting through the "
                             f"part {split.start}:{split.stop} of dim {split.dim} this rank holds")
        shape = list(node.attrs["shape"])
        shape[1] = (last - first) // inner_out
        self._emit(node, node.inputs, {**node.attrs, "shape": tuple(shape)})
        self.layout[node.outputs[0]] = Split(1, first // inner_out, last // inner_out, after[1])

    def _kv_write(self, node: Node, splits: list[Split | None]) -> None:
        k, v = splits[2], splits[3]
        if k is None or k != v:
            raise GraphError(f"tensor parallelism: %{node.name} writes k and v split differently ({k}, {v})")
        for cache in node.inputs[:2]:
            shape = list(self.g.states[cache].shape)
            shape[2] = k.stop - k.start
            self.g.states[cache] = self.types[cache] = self.g.states[cache].with_shape(tuple(shape))
        self._emit(node, node.inputs)
        for cache in (*node.inputs[:2], *node.outputs):
            self.layout[cache] = Split(2, k.start, k.stop, k.full)

    def _attention(self, node: Node, splits: list[Split | None]) -> None:
        q, cache = splits[0], splits[1]
        if q is None or cache is None or splits[2] != cache:
            raise GraphError(f"tensor parallelism: %{node.name} reads q and the caches split differently")
        group = q.full // cache.full
        if q.start // group != cache.start or -(-q.stop // group) != cache.stop:
            raise GraphError(f"tensor parallelism: %{node.name}'s query heads {q.start}:{q.stop} read kv heads "
                             f"other than the {cache.start}:{cache.stop} this rank holds")
        self._emit(node, node.inputs)
        self.layout[node.outputs[0]] = q

    def _pointwise(self, node: Node, splits: list[Split | None]) -> None:
        rank = node.output_types[0].rank
        wide = {s for v, s in zip(node.inputs, splits)
                if self.declared[v].rank == rank and self.declared[v].dtype.is_float}
        split = splits[0]
        mixed = len(wide) != 1 or split is None
        reduces = not mixed and node.op in ("rms_norm", "rope") and split.dim == rank - 1
        if mixed or reduces or (node.op == "gather_rows" and split.dim == 0):
            raise GraphError(f"tensor parallelism: %{node.name} ({node.op}) mixes values split and whole, or "
                             f"works along the split dim")
        self._emit(node, node.inputs)
        for out in node.outputs:
            self.layout[out] = split
