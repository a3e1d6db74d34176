"""One rank's weights in a sharded graph: checkpoint tensors cut to the rank's slice (Graph.shards, which the loader
reads alone), and params made at load from rows of them (Graph.derived) re-derived from those slices, so that each
rank holds, and mostly reads, only what its part of the graph multiplies."""

from pegainfer.errors import GraphError
from pegainfer.ir.graph import Derivation, Graph, Shard
from pegainfer.ir.types import TensorType
from pegainfer.passes.rewrite import fresh_name


class RankWeights:
    """Slices `g`'s weights in place, keeping `types` (the sharder's view of every value) in step."""

    def __init__(self, g: Graph, types: dict[str, TensorType]) -> None:
        self.g, self.types = g, types

    def slice(self, name: str, axis: int, start: int, stop: int, pad: int = 0) -> None:
        """Declares this rank's slice of checkpoint tensor `name` (a param, or a source of a derived one)."""
        full = self.g.shards[name].full if name in self.g.shards else self.full_type(name)
        shard = Shard(axis, start, stop, full, pad)
        if self.g.shards.get(name, shard) != shard:
            raise GraphError(f"tensor parallelism: {name} is read split two ways ({self.g.shards[name]} and {shard})")
        self.g.shards[name] = shard
        if name in self.g.params:
            self.set_type(name, shard.type)

    def set_type(self, name: str, type_: TensorType) -> None:
        self.g.params[name] = self.types[name] = type_

    def full_type(self, name: str) -> TensorType:
        """The stored tensor's type, before any slicing."""
        if name in self.g.params:
            return self.g.params[name]
        for derivation in self.g.derived.values():
            if name in derivation.sources:
                return derivation.source_types[derivation.sources.index(name)]
        raise AssertionError(f"{name} is no param of {self.g.name}")

    def rows(self, name: str, ranges: list[tuple[int, int]]) -> str:
        """Cuts weight `name` (a checkpoint param, or one derived from rows of some) to its rows in `ranges`
        (ascending); returns the param that holds them: `name` itself, or a param derived from it where the rows
        are not one range of a checkpoint tensor."""
        if name not in self.g.derived and len(ranges) == 1:
            self.slice(name, 0, *ranges[0])
            return name
        derivation = self.g.derived.get(name) or Derivation((name,), (self.g.params[name],))
        if derivation.dequantize is not None or derivation.axis != 0:
            raise GraphError(f"tensor parallelism of {name}, made at load from {', '.join(derivation.sources)} "
                             f"(dequantized, or joined along axis {derivation.axis}), is not implemented")
        rederived = self._rederive(derivation, _taken(derivation.pieces(), ranges))
        target = name
        if name not in self.g.derived:  # several ranges of a checkpoint tensor: a param made of them at load
            target = fresh_name(self.g, name + ".part")
            self.g.params.pop(name)
            self.types.pop(name, None)
        self.g.derived[target] = rederived
        whole = derivation.source_types[0]
        self.set_type(target, whole.with_shape((sum(b - a for a, b in ranges), *whole.shape[1:])))
        return target

    def _rederive(self, derivation: Derivation, pieces: list[tuple[str, int, int]]) -> Derivation:
        """The derivation of `pieces` (source, first row, stop) from each source's slice: the rows it spans."""
        whole = dict(zip(derivation.sources, derivation.source_types))
        sources = list(dict.fromkeys(source for source, _, _ in pieces))
        spans = {s: (min(a for x, a, _ in pieces if x == s), max(b for x, _, b in pieces if x == s)) for s in sources}
        for source, (start, stop) in spans.items():
            if (start, stop) != (0, whole[source].shape[0]):
                self.slice(source, 0, start, stop)
        types = tuple(self.g.shards[s].type if s in self.g.shards else whole[s] for s in sources)
        rows = tuple((sources.index(s), a - spans[s][0], b - spans[s][0]) for s, a, b in _merged(pieces))
        return Derivation(tuple(sources), types, 0, rows)


def _taken(pieces: list[tuple[str, int, int]], ranges: list[tuple[int, int]]) -> list[tuple[str, int, int]]:
    """The pieces of the rows in `ranges` of a param laid out as `pieces` one after another."""
    out, offset = [], 0
    for source, start, stop in pieces:
        for a, b in ranges:
            lo, hi = max(a, offset), min(b, offset + stop - start)
            if lo < hi:
                out.append((source, start + lo - offset, start + hi - offset))
        offset += stop - start
    return out


def _merged(pieces: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Consecutive pieces of one source's consecutive rows as one."""
    out: list[tuple[str, int, int]] = []
    for source, start, stop in pieces:
        if out and out[-1][0] == source and out[-1][2] == start:
            out[-1] = (source, out[-1][1], stop)
        else:
            out.append((source, start, stop))
    return out
