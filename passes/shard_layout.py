"""How a rank holds a value the sharding pass split (passes/shard.py): one range along a dim, or a range of each of
several blocks (a linear's rows laid out as q | gate, or q | k | v, each block split by its own heads); and which
part of a count of heads or rows a rank takes."""

from dataclasses import dataclass

from pegainfer.errors import GraphError


@dataclass(frozen=True)
class Split:
    """A value of which this rank holds [start, stop) of `full` along `dim`."""
    dim: int
    start: int
    stop: int
    full: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def ranges(self) -> list[tuple[int, int]]:
        return [(self.start, self.stop)]

    def same_part(self, other: "Split") -> bool:
        """The same range of the same count, whatever the dim (a head's value and its per-head scalars)."""
        return (self.start, self.stop, self.full) == (other.start, other.stop, other.full)


@dataclass(frozen=True)
class Blocks:
    """A value whose `dim` is the concatenation of blocks, of each of which this rank holds the part `parts[i]`
    (a Split relative to its block)."""
    dim: int
    parts: tuple[Split, ...]

    @property
    def full(self) -> int:
        return sum(part.full for part in self.parts)

    @property
    def size(self) -> int:
        return sum(part.size for part in self.parts)

    def ranges(self) -> list[tuple[int, int]]:
        """The rows held, in the whole value's numbering."""
        out, offset = [], 0
        for part in self.parts:
            out.append((offset + part.start, offset + part.stop))
            offset += part.full
        return out


Layout = Split | Blocks


def partition(units: int, world: int, rank: int, what: str) -> tuple[int, int]:
    """(parts, this rank's part) of `units` heads or rows: `world` parts, or fewer with ranks sharing a part
    (KV heads fewer than the ranks)."""
    if units % world == 0:
        return world, rank
    if world % units == 0:
        return units, rank * units // world
    raise GraphError(f"tensor parallelism over {world} ranks: {what} has {units} heads or rows, which neither "
                     f"divide into {world} parts nor are a divisor of {world}")


def part_of(size: int, units: int, world: int, rank: int, what: str, dim: int) -> Split:
    """This rank's Split of `size` rows made of `units` heads (or rows), along `dim`."""
    parts, part = partition(units, world, rank, what)
    per = size // parts
    return Split(dim, part * per, (part + 1) * per, size)


def vocab_part(vocab: int, world: int, rank: int, what: str) -> tuple[int, int, int]:
    """(first id, id after the last, padding rows) of this rank's part of a vocabulary: ceil(vocab / world) each."""
    if vocab < world:
        raise GraphError(f"tensor parallelism over {world} ranks: {what} has {vocab} rows, fewer than the ranks")
    per = -(-vocab // world)
    start = min(rank * per, vocab)
    stop = min(start + per, vocab)
    return start, stop, per - (stop - start)


def check_grouped_heads(what: str, q: Layout, kv: Layout) -> None:
    """A rank's query (or value) heads q read only the key heads kv it holds (grouped heads, perhaps shared)."""
    group = q.full // kv.full
    if not isinstance(q, Split) or not isinstance(kv, Split) or q.start // group != kv.start or \
            -(-q.stop // group) != kv.stop:
        raise GraphError(f"tensor parallelism: {what}'s heads {q} read key heads other than the {kv} this rank "
                         f"holds")
