"""Packing one step: the chunks of tokens that each sequence processes become the graph's step inputs
(see ir/step.py and the layout described in ir/ops/attention.py)."""

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from pegainfer.ir.step import LORA_SLOTS, STATE_SLOTS, TOKEN_BITMASK, TOKEN_MASK_INDEX
from pegainfer.runtime.device_sampling import greedy_inputs, no_penalties
from pegainfer.runtime.kv_blocks import BlockAllocator, BlockTable


@dataclass
class Sequence:
    """A sequence's tokens (prompt and generated) and how many of them already have their KV in the cache."""
    seq_id: int
    token_ids: list[int]
    num_cached: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    lora_slot: int = -1  # its adapter's slot of the LoRA tables (-1: the base model)


@dataclass(frozen=True)
class Chunk:
    """The next `num_tokens` uncached tokens of `seq`, processed in one step (a prompt piece or one decode token);
    the step draws a token at each of the last `draws` of them (more than one: a speculative step's drafts are
    verified, runtime/speculative.py)."""
    seq: Sequence
    num_tokens: int
    draws: int = 1


def pack_step(chunks: list[Chunk], allocator: BlockAllocator, *, all_logits: bool = False,
              lora: bool = False) -> dict[str, np.ndarray]:
    """Allocates KV blocks (and state slots) for the chunks and returns the step's inputs. Logits rows are each
    chunk's last token, or every token with `all_logits` (for scoring a prompt); `lora`: with each token's adapter
    slot (a graph with LoRA tables)."""
    assert chunks, "a step needs at least one chunk"
    ids, positions, slots, starts, logits_rows = [], [], [], [], []
    size = allocator.block_size
    for chunk in chunks:
        seq, start, count = chunk.seq, chunk.seq.num_cached, chunk.num_tokens
        end = start + count
        assert 0 < count and end <= len(seq.token_ids), \
            f"chunk of {count} tokens at {start} overruns sequence {seq.seq_id} of {len(seq.token_ids)}"
        blocks = seq.table.blocks
        if len(blocks) * size < end or allocator.needs_slot(seq.table):
            allocator.grow(seq.table, end)
        row = len(ids)
        starts.append(row)
        if count == 1:  # a decode token: the common row, kept free of per-token calls
            ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(blocks[start // size] * size + start % size)
        else:
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [blocks[p // size] * size + p % size for p in range(start, end)]
        logits_rows += range(row if all_logits else row + count - chunk.draws, row + count)
    lists = [chunk.seq.table.blocks for chunk in chunks]
    lengths = np.array([len(blocks) for blocks in lists], dtype=np.int64)
    tables = np.zeros((len(chunks), int(lengths.max())), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < lengths[:, None]] = np.fromiter(chain.from_iterable(lists), np.int32,
                                                                         int(lengths.sum()))
    return {
        "input_ids": np.array(ids, dtype=np.int32),
        "positions": np.array(positions, dtype=np.int32),
        "slot_mapping": np.array(slots, dtype=np.int32),
        "block_tables": tables,
        "seq_starts": np.array(starts, dtype=np.int32),
        "query_lens": np.array([c.num_tokens for c in chunks], dtype=np.int32),
        "context_lens": np.array([c.seq.num_cached + c.num_tokens for c in chunks], dtype=np.int32),
        "logits_indices": np.array(logits_rows, dtype=np.int32),
        **greedy_inputs(len(logits_rows)),  # the sampler tail's inputs; engine.sample replaces them
        TOKEN_BITMASK: np.zeros((1, 1), dtype=np.int32), TOKEN_MASK_INDEX: np.full(len(logits_rows), -1, np.int32),
        **no_penalties(len(logits_rows)),
        **({STATE_SLOTS: np.array([c.seq.table.state_slot for c in chunks], dtype=np.int32)}
           if allocator.state_slots else {}),
        **({LORA_SLOTS: np.repeat(np.array([c.seq.lora_slot for c in chunks], np.int32),
                                  [c.num_tokens for c in chunks])} if lora else {}),
    }


def release_sequence(allocator: BlockAllocator, seq: Sequence) -> None:
    """Frees the sequence's KV blocks and state slot; stepped again, it would be recomputed from its first token."""
    allocator.release(seq.table)
    seq.num_cached = 0


def commit_step(chunks: list[Chunk]) -> None:
    """Marks the chunks' tokens as cached once the step that wrote their KV has run."""
    for chunk in chunks:
        chunk.seq.num_cached += chunk.num_tokens
