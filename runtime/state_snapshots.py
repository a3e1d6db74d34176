"""Recurrent state at cached block boundaries, for the prefix cache of a model with recurrent layers.

A prefix hit hands a sequence the KV of its cached blocks, but a recurrent layer's state is one row a sequence, as
of its last step. So the scheduler copies a sequence's state row into a snapshot row whenever a step ends on a full
block boundary whose block is cached (prompt chunks are cut to end on one), keyed by that block's hash; a hit is
then cut back to the deepest cached block with a snapshot, which is copied into the sequence's own row before its
first step. Rows are few and large (megabytes a layer), so they are reused least recently used first, and a
snapshot goes with its block when the prefix cache evicts that. Under async scheduling the copy is queued when the
step ending on the boundary is launched (a later step moves the state on before that one is read) into a row
reserved without a name, named once the read knows the block's tokens and so its hash.
"""

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, rows: range) -> None:
        self._free = list(reversed(rows))
        self._row_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.capacity = len(rows)
        self.taken = 0  # snapshots copied out of sequences' rows
        self.restored = 0  # copied back into a sequence's row on a prefix hit

    @property
    def num_stored(self) -> int:
        return len(self._row_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._row_of

    def deepest(self, hashes: list[bytes]) -> int:
        """How many of a prefix hit's blocks to take: up to the deepest one whose boundary has a snapshot."""
        return next((n for n in range(len(hashes), 0, -1) if hashes[n - 1] in self._row_of), 0)

    def restore(self, block_hash: bytes) -> int:
        """The row of the snapshot at `block_hash`'s boundary, now the most recently used."""
        self._row_of.move_to_end(block_hash)
        self.restored += 1
        return self._row_of[block_hash]

    def reserve(self) -> int | None:
        """A row for a state whose boundary's hash is not known yet: a free one, else the least recently used
        snapshot's; None while every row is reserved. It is `name`d or `release`d later."""
        if self._free:
            return self._free.pop()
        return self._row_of.popitem(last=False)[1] if self._row_of else None

    def name(self, row: int, block_hash: bytes) -> None:
        """A reserved row now holds the state at `block_hash`'s boundary."""
        assert block_hash not in self._row_of, "one snapshot a boundary"
        self._row_of[block_hash] = row
        self.taken += 1

    def release(self, row: int) -> None:
        """A reserved row given back unnamed (its sequence ended before its boundary's hash was known)."""
        self._free.append(row)

    def drop(self, block_hash: bytes) -> None:
        """Forgets the snapshot at `block_hash`'s boundary, if any (its block was evicted, or superseded)."""
        row = self._row_of.pop(block_hash, None)
        if row is not None:
            self._free.append(row)


def chunk_to_boundary(start: int, count: int, block_size: int) -> int:
    """A prompt chunk of `count` tokens from `start`, cut to end on the last block boundary it crosses, so that its
    state can be snapshotted there; the tokens past that boundary run in the next step."""
    end = start + count
    boundary = end // block_size * block_size
    return boundary - start if start < boundary < end else count
