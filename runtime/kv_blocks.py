"""Paged KV-cache bookkeeping: a pool of fixed-size blocks and each sequence's block table."""

from dataclasses import dataclass, field


class OutOfBlocks(Exception):
    """The pool cannot hold what was asked; the scheduler decides whether to wait, preempt or reject."""


class BlockAllocator:
    """A free list of block ids 0 .. num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int, reserved: int = 0) -> None:
        """Blocks 0 .. reserved-1 are never handed out (the GPU engine's padding block)."""
        assert num_blocks > reserved >= 0 and block_size > 0, f"bad pool: {num_blocks} blocks of {block_size}"
        self.num_blocks = num_blocks - reserved
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, reserved - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, table: "BlockTable", num_tokens: int) -> None:
        """Gives `table` enough blocks to hold `num_tokens` tokens."""
        needed = self.blocks_for(num_tokens) - len(table.blocks)
        if needed > len(self._free):
            raise OutOfBlocks(f"need {needed} more KV blocks, {len(self._free)} free of {self.num_blocks}")
        for _ in range(max(needed, 0)):
            table.blocks.append(self._free.pop())

    def release(self, table: "BlockTable") -> None:
        self._free.extend(reversed(table.blocks))
        table.blocks.clear()


@dataclass
class BlockTable:
    """A sequence's blocks in order: the token at position p lives at slot blocks[p // size] * size + p % size of
    the flat [num_blocks * block_size] pool."""
    blocks: list[int] = field(default_factory=list)
