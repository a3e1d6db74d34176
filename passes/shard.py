"""Tensor parallelism: the graph of one rank of `world`. Projections into heads and the MLP's gate/up split by
output rows (their regions found in passes/shard_regions.py; a projection whose rows are several blocks, q | gate
or q | k | v, splits each block by its heads), the projections out of them by input columns with an all-reduce of
their partial sums; the embedding and the LM head split the vocabulary (padded to a multiple of the ranks; the
logits all-gathered and the padding cut); KV heads fewer than the ranks are replicated, each rank keeping the one
its query heads read; latent attention and Gated DeltaNet split by heads (passes/shard_mixers.py); MoE experts
split inside, or whole across the ranks with expert parallelism (passes/shard_experts.py). Every rank's weights
are slices of the checkpoint's tensors, recorded in `Graph.shards` for the loader."""

from collections import Counter
from dataclasses import dataclass
from math import prod

from pegainfer.errors import GraphError
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.registry import infer_types
from pegainfer.passes import shard_experts, shard_mixers
from pegainfer.passes.manager import Pass, PassLog
from pegainfer.passes.rewrite import consumers, fresh_name
from pegainfer.passes.shard_layout import Blocks, Layout, Split, check_grouped_heads, part_of, vocab_part
from pegainfer.passes.shard_regions import column_parallel_regions, splits_along_heads
from pegainfer.passes.shard_weights import RankWeights


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


def tensor_parallel(parallel: Parallelism) -> Pass:
    """The sharding pass for one rank."""
    assert parallel.sharded, f"sharding for one rank: {parallel}"

    def shard_tensor_parallel(graph: Graph, log: PassLog) -> Graph:
        """Splits the graph for one rank (tensor parallelism): heads and MLP rows, all-reduces after the
        projections out of them, the vocabulary of the embedding and LM head, the experts."""
        for g in graph.all_graphs():
            Sharder(g, parallel, log, root=g is graph).run()
        experts = ", experts whole across the ranks" if parallel.expert_parallel else ""
        log.note(f"rank {parallel.rank} of {parallel.world}{experts}")
        return graph
    return Pass("shard_tensor_parallel", "sharding", shard_tensor_parallel)


class Sharder:
    """Rewrites one graph (a body or the top graph) node by node into this rank's, tracking how each value is
    split (`layout`); the op-specific rewrites of passes/shard_experts.py and shard_mixers.py use its helpers."""

    def __init__(self, g: Graph, parallel: Parallelism, log: PassLog, root: bool) -> None:
        self.g, self.parallel, self.log, self.root = g, parallel, log, root
        self.world, self.rank = parallel.world, parallel.rank
        self.types = g.value_types()  # this rank's types, updated as values are split
        self.declared = dict(self.types)  # the unsharded types
        self.weights = RankWeights(g, self.types)
        self.readers = consumers(g)
        self.layout: dict[str, Layout] = {}
        self.nodes: list[Node] = []
        self.columns = self._column_entries()

    def _column_entries(self) -> set[str]:
        """The linears split by output rows; a note for each region left replicated, naming its entries other
        than the row-parallel exits of split regions (an o_proj feeding the residual stream)."""
        regions = column_parallel_regions(self.g)
        split = {v for region in regions if not region.blocker for v in region.values}
        exits = {n.name for n in self.g.nodes if n.op == "linear" and n.inputs[0] in split}
        for region in regions:
            names = [f"%{n.name}" for n in region.entries if n.name not in exits]
            if region.blocker and names:
                self.log.note(f"{self.g.name}: {', '.join(names)} replicated: {region.blocker}")
        return {n.name for region in regions if not region.blocker for n in region.entries}

    def run(self) -> None:
        for node in self.g.nodes:
            self._visit(node)
        self.g.nodes = self._merged_sums()
        split = [v for v in self.g.outputs if v in self.layout]
        if split:
            raise GraphError(f"tensor parallelism: {self.g.name} returns %{split[0]}, which is split across ranks")
        read = {v for node in self.g.nodes for v in node.inputs}
        for name in [p for p in self.g.params if p not in read]:  # a row-parallel bias only rank 0 adds
            self.g.params.pop(name)
            self.g.derived.pop(name, None)
        sources = {s for d in self.g.derived.values() for s in d.sources}
        for name in [s for s in self.g.shards if s not in self.g.params and s not in sources]:
            self.g.shards.pop(name)

    def _merged_sums(self) -> list[Node]:
        """The nodes with add(all_reduce(a), all_reduce(b)) as all_reduce(add(a, b)), an all-reduce scaled by whole
        rows (a gated shared expert's) taken as the all-reduce of the scaled part: one collective where a MoE
        block's routed and shared experts had one each."""
        producers = {out: node for node in self.nodes for out in node.outputs}
        reads = Counter([*(v for node in self.nodes for v in node.inputs), *self.g.outputs])

        def reduced(value: str) -> Node | None:
            node = producers.get(value)
            return node if node is not None and node.op == "all_reduce" and reads[value] == 1 else None

        def partial(value: str) -> tuple[list[Node], list[Node]] | None:
            """(nodes dropped, nodes giving this rank's part of value) for a summed value, else None."""
            node = producers.get(value)
            if reduced(value):
                return [node], []
            if node is None or node.op != "scale_rows" or reads[value] != 1 or not reduced(node.inputs[0]) or \
                    node.inputs[1] in self.layout:
                return None
            part = self.fresh(value + ".partial")
            rows = producers[node.inputs[0]].inputs[0]
            return [producers[node.inputs[0]], node], [Node("scale_rows", (rows, node.inputs[1]), (part,),
                                                           node.output_types, node.attrs)]

        merged: list[Node] = []
        dropped: set[int] = set()
        for node in self.nodes:
            parts = [partial(v) for v in node.inputs] if node.op == "add" else [None]
            if not all(parts):
                merged.append(node)
                continue
            summed = tuple(made[-1].outputs[0] if made else gone[0].inputs[0] for gone, made in parts)
            total = self.fresh(node.outputs[0] + ".partial")
            merged += [*(n for _, made in parts for n in made),
                       Node("add", summed, (total,), node.output_types, node.attrs),
                       Node("all_reduce", (total,), node.outputs, node.output_types, {"world": self.world})]
            dropped.update(id(n) for gone, _ in parts for n in gone)
        return [node for node in merged if id(node) not in dropped]

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
            return shard_experts.shard_experts(self, node)
        if not any(splits):
            return self.nodes.append(node)
        if node.op in shard_mixers.MIXERS:
            return shard_mixers.MIXERS[node.op](self, node, splits)
        if node.op == "reshape":
            return self._reshape(node, splits[0])
        if node.op == "kv_write":
            return self._kv_write(node, splits)
        if node.op == "paged_attention":
            return self._attention(node, splits)
        if node.op == "split":
            return self._split(node, splits[0])
        if splits_along_heads(node, self.declared) or node.op == "gather_rows":
            return self._pointwise(node, splits)
        raise GraphError(f"tensor parallelism: %{node.name} ({node.op}) reads a value split across ranks and has "
                         f"no split form")

    # --- helpers for the op rewrites -----------------------------------------------------------------------------

    def emit(self, node: Node, inputs: tuple[str, ...], attrs: dict | None = None,
             outputs: tuple[str, ...] | None = None) -> Node:
        """`node` over `inputs` (and `attrs`), its output types inferred from this rank's input types."""
        attrs = dict(node.attrs if attrs is None else attrs)
        types = infer_types(node.op, [self.types[v] for v in inputs], attrs)
        out = Node(node.op, inputs, outputs or node.outputs, types, attrs)
        self.types.update(zip(out.outputs, types))
        self.nodes.append(out)
        return out

    def reduced(self, node: Node, inputs: tuple[str, ...], attrs: dict | None = None,
                op: str = "all_reduce", **collective: int) -> None:
        """`node` over this rank's inputs into a fresh value, then a collective into node's output."""
        partial = self.fresh(node.outputs[0] + (".partial" if op == "all_reduce" else ".shard"))
        self.emit(node, inputs, attrs, outputs=(partial,))
        self.emit(Node(op, (), (node.outputs[0],), ()), (partial,), {"world": self.world, **collective})

    def fresh(self, hint: str) -> str:
        """A name that no value of the graph, before or after this rank's rewrite so far, has."""
        taken = {out for node in self.nodes for out in node.outputs}
        name, suffix = fresh_name(self.g, hint), 1
        while name in taken:
            name, suffix = fresh_name(self.g, f"{hint}.{suffix}"), suffix + 1
        return name

    def resize_state(self, name: str, dim: int, size: int) -> None:
        """A state tensor (a cache, a recurrent state) holding `size` of its `dim` on this rank."""
        shape = list(self.g.states[name].shape)
        shape[dim] = size
        self.g.states[name] = self.types[name] = self.g.states[name].with_shape(tuple(shape))

    def weight(self, node: Node) -> str:
        """A linear's weight, which must be a checkpoint tensor to be sliced."""
        weight = node.inputs[1]
        if weight not in self.g.params or weight in self.g.derived:
            raise GraphError(f"tensor parallelism of %{node.name} over {weight}, a weight made at load or in the "
                             f"step (an FP8 one's dequantize), is not implemented")
        return weight

    # --- ops -----------------------------------------------------------------------------------------------------

    def _embedding(self, node: Node) -> None:
        table = node.inputs[1]
        start, stop, pad = vocab_part(self.declared[table].shape[0], self.world, self.rank, table)
        self.weights.slice(table, 0, start, stop, pad)
        self.reduced(node, node.inputs, {**node.attrs, "first_id": start})

    def _vocab_head(self, node: Node) -> None:
        weight = self.weight(node)
        vocab = self.declared[weight].shape[0]
        start, stop, pad = vocab_part(vocab, self.world, self.rank, weight)
        self.weights.slice(weight, 0, start, stop, pad)
        padded = (stop - start + pad) * self.world
        if padded == vocab:
            return self.reduced(node, node.inputs, op="all_gather", axis=-1)
        logits = node.outputs[0]
        gathered = self.fresh(logits + ".padded")
        self.reduced(Node(node.op, node.inputs, (gathered,), node.output_types, node.attrs), node.inputs,
                     op="all_gather", axis=-1)
        padding = self.fresh(logits + ".padding")
        self.emit(Node("split", (), (logits, padding), ()), (gathered,), {"sizes": (vocab, padded - vocab)})

    def _column_parallel(self, node: Node) -> None:
        """Output rows split by heads (or rows), block by block where the output is cut into blocks."""
        rows = self.declared[node.inputs[1]].shape[0]
        dim = self.declared[node.outputs[0]].rank - 1
        parts = tuple(part_of(size, units, self.world, self.rank, node.inputs[1], dim)
                      for size, units in self._column_blocks(node.outputs[0], rows))
        layout = parts[0] if len(parts) == 1 else Blocks(dim, parts)
        inputs = (node.inputs[0], *(self.weights.rows(w, layout.ranges()) for w in node.inputs[1:]))
        self.emit(node, inputs)
        self.layout[node.outputs[0]] = layout

    def _column_blocks(self, value: str, rows: int) -> list[tuple[int, int]]:
        """(rows, heads) of each block of a linear's output: one block of the heads it is reshaped into (its rows
        when none), or the parts a split cuts it into (through a per-channel convolution), each by its heads."""
        for reader in self.readers.get(value, []):
            if reader.op == "reshape" and reader.output_types[0].rank == 3:
                return [(rows, reader.output_types[0].shape[1])]
            if reader.op == "split" and self.declared[value].rank == 2:
                return [(size, self._heads_of(out) or size) for size, out in zip(reader.attrs["sizes"],
                                                                                reader.outputs)]
            if reader.op == "causal_conv1d" and reader.inputs[0] == value:
                return self._column_blocks(reader.outputs[1], rows)
        return [(rows, rows)]

    def _heads_of(self, value: str) -> int:
        """The heads a value is reshaped into (0: none), which its split must not cut."""
        for reader in self.readers.get(value, []):
            if reader.op == "reshape" and reader.output_types[0].rank == 3:
                return reader.output_types[0].shape[1]
        return 0

    def _row_parallel(self, node: Node, split: Layout) -> None:
        weight = self.weight(node)
        if not isinstance(split, Split) or split.dim != self.types[node.inputs[0]].rank - 1 or \
                split.size * self.world != split.full:
            raise GraphError(f"tensor parallelism: %{node.name} would sum parts of its input that ranks share or "
                             f"that lie in blocks ({split})")
        self.weights.slice(weight, 1, split.start, split.stop)
        bias = node.inputs[2:] if self.rank == 0 else ()  # added once, by rank 0
        self.reduced(node, (node.inputs[0], weight, *bias))

    def _reshape(self, node: Node, split: Layout) -> None:
        before, after = self.declared[node.inputs[0]].shape, node.output_types[0].shape
        inner_in, inner_out = prod(before[2:]), prod(after[2:])
        if not isinstance(split, Split) or split.dim != 1 or split.start * inner_in % inner_out or \
                split.stop * inner_in % inner_out:
            raise GraphError(f"tensor parallelism: %{node.name} reshapes {before} to {after}, cutting through the "
                             f"part {split} this rank holds")
        first, last = split.start * inner_in, split.stop * inner_in
        shape = list(node.attrs["shape"])
        shape[1] = (last - first) // inner_out
        self.emit(node, node.inputs, {**node.attrs, "shape": tuple(shape)})
        self.layout[node.outputs[0]] = Split(1, first // inner_out, last // inner_out, after[1])

    def _kv_write(self, node: Node, splits: list[Layout | None]) -> None:
        k, v = splits[2], splits[3]
        if k is None or k != v:
            raise GraphError(f"tensor parallelism: %{node.name} writes k and v split differently ({k}, {v})")
        for cache in node.inputs[:2]:
            self.resize_state(cache, 2, k.size)
        self.emit(node, node.inputs)
        for cache in (*node.inputs[:2], *node.outputs):
            self.layout[cache] = Split(2, k.start, k.stop, k.full)

    def _attention(self, node: Node, splits: list[Layout | None]) -> None:
        q, cache = splits[0], splits[1]
        if q is None or cache is None or splits[2] != cache:
            raise GraphError(f"tensor parallelism: %{node.name} reads q and the caches split differently")
        check_grouped_heads(f"%{node.name}", q, cache)
        self.emit(node, node.inputs)
        self.layout[node.outputs[0]] = q

    def _split(self, node: Node, layout: Layout) -> None:
        """Per head ([tokens, heads, dims] into parts of each head's dims), or a value in blocks into its blocks."""
        sizes, last = tuple(node.attrs["sizes"]), self.declared[node.inputs[0]].rank - 1
        if isinstance(layout, Blocks) and layout.dim == last and tuple(p.full for p in layout.parts) == sizes:
            self.emit(node, node.inputs, {**node.attrs, "sizes": tuple(p.size for p in layout.parts)})
            for out, part in zip(node.outputs, layout.parts):
                self.layout[out] = Split(last, part.start, part.stop, part.full)
            return None
        if isinstance(layout, Split) and layout.dim != last:
            self.emit(node, node.inputs)
            self.layout.update(dict.fromkeys(node.outputs, layout))
            return None
        raise GraphError(f"tensor parallelism: %{node.name} splits {self.declared[node.inputs[0]]} into {list(sizes)} "
                         f"along the dim this rank holds {layout} of")

    def _pointwise(self, node: Node, splits: list[Layout | None]) -> None:
        rank = node.output_types[0].rank
        wide = {s for v, s in zip(node.inputs, splits)
                if self.declared[v].rank == rank and self.declared[v].dtype.is_float}
        layout = splits[0]
        mixed = len(wide) != 1 or layout is None
        reduces = not mixed and node.op in ("rms_norm", "rope") and layout.dim == rank - 1
        if mixed or reduces or (node.op == "gather_rows" and layout.dim == 0):
            raise GraphError(f"tensor parallelism: %{node.name} ({node.op}) mixes values split and whole, or "
                             f"works along the split dim")
        inputs = tuple(self._broadcast(v, layout, rank) if s is None else v for v, s in zip(node.inputs, splits))
        self.emit(node, inputs)
        for out in node.outputs:
            self.layout[out] = layout

    def _broadcast(self, value: str, layout: Layout, rank: int) -> str:
        """An input broadcast against a split value: sliced where it runs along the split dim (per-head params
        such as a decay's A_log), else read whole."""
        declared = self.declared[value]
        axis = layout.dim - (rank - declared.rank)
        if not declared.dtype.is_float or declared.rank >= rank or axis < 0 or declared.shape[axis] != layout.full:
            return value
        if value in self.g.params and value not in self.g.derived and axis == 0:
            return self.weights.rows(value, layout.ranges())
        raise GraphError(f"tensor parallelism: %{value} ({declared}) runs along a split dim and is no "
                         f"checkpoint tensor to slice")

