"""Paged KV-cache bookkeeping: a pool of fixed-size blocks and each sequence's block table, and for models with
recurrent layers a pool of state slots, one per running sequence (its row of every recurrent state pool), beside
rows kept for the prefix cache's state snapshots (runtime/state_snapshots.py)."""

from dataclasses import dataclass, field

from pegainfer.errors import RequestError


def check_fits(allocator: "BlockAllocator", prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """Refuses a request that could never run, whatever else is running; the numbers say why."""
    if prompt_len >= max_model_len:
        raise RequestError(f"the prompt has {prompt_len} tokens; the maximum context length is {max_model_len} "
                           f"tokens, so a prompt may have at most {max_model_len - 1}")
    total = min(prompt_len + max_tokens, max_model_len)
    blocks = allocator.blocks_for(total)
    if blocks > allocator.num_blocks:
        raise RequestError(
            f"the request needs {blocks} KV blocks ({prompt_len} prompt + {total - prompt_len} generated tokens, "
            f"{allocator.block_size} tokens a block) and the KV cache holds {allocator.num_blocks} blocks in all: "
            f"it can never fit")


class OutOfBlocks(Exception):
    """The pool cannot hold what was asked; the scheduler decides whether to wait, preempt or reject."""


class BlockAllocator:
    """A free list of block ids 0 .. num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int, reserved: int = 0, state_slots: int = 0,
                 snapshot_slots: int = 0, spare_slots: int = 0) -> None:
        """Blocks 0 .. reserved-1 are never handed out (the GPU engine's padding block), nor, of `state_slots`
        slots (0: a model without recurrent state), slots 0 .. reserved-1. Rows state_slots .. state_slots +
        snapshot_slots - 1 of the state pools hold snapshots, never a running sequence; the `spare_slots` rows
        after them hold a speculating sequence's state from before its drafts, to roll back to."""
        assert num_blocks > reserved >= 0 and block_size > 0, f"bad pool: {num_blocks} blocks of {block_size}"
        assert state_slots == 0 or state_slots > reserved, f"bad pool: {state_slots} state slots"
        self.num_blocks = num_blocks - reserved
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, reserved - 1, -1))
        self.state_slots = max(state_slots - reserved, 0)  # the slots sequences may hold
        self._free_slots = list(range(state_slots - 1, reserved - 1, -1))
        self.snapshot_rows = range(state_slots, state_slots + snapshot_slots) if state_slots else range(0)
        self.spare_rows = range(self.snapshot_rows.stop, self.snapshot_rows.stop + spare_slots) if state_slots \
            else range(0)

    @property
    def state_rows(self) -> int:
        """Rows of each recurrent state pool the engine allocates: sequences', reserved, snapshots' and spares'."""
        return self.spare_rows.stop if self.state_slots else 0

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def needs_slot(self, table: "BlockTable") -> bool:
        return self.state_slots > 0 and table.state_slot < 0

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
        if self.needs_slot(table):
            self.take_slot(table)
        for _ in range(max(needed, 0)):
            table.blocks.append(self._free.pop())

    def take_slot(self, table: "BlockTable") -> int:
        """Gives `table` a state slot (before its first step, so that a restored snapshot can be copied in)."""
        assert self.needs_slot(table), "the table holds a slot already, or the model has no recurrent state"
        if not self._free_slots:
            raise OutOfBlocks(f"need a state slot, none free of {self.state_slots}")
        table.state_slot = self._free_slots.pop()
        return table.state_slot

    def release(self, table: "BlockTable") -> None:
        self._free.extend(reversed(table.blocks))
        table.blocks.clear()
        if table.state_slot >= 0:
            self._free_slots.append(table.state_slot)
            table.state_slot = -1


@dataclass
class BlockTable:
    """A sequence's blocks in order: the token at position p lives at slot blocks[p // size] * size + p % size of
    the flat [num_blocks * block_size] pool. `state_slot`: its row of the recurrent state pools (-1: none)."""
    blocks: list[int] = field(default_factory=list)
    state_slot: int = -1
