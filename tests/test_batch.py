"""Packing a step: slots, block tables and row offsets for a mix of prefill and decode chunks; the block pool."""

import numpy as np
import pytest

from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step
from pegainfer.runtime.kv_blocks import BlockAllocator, OutOfBlocks


def test_pack_step_for_a_prefill_and_a_decode():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    decoding = Sequence(0, [1, 2, 3, 4, 5, 6])
    pack_step([Chunk(decoding, 5)], allocator)
    commit_step([Chunk(decoding, 5)])  # 5 cached, one token left to decode
    prefill = Sequence(1, [7, 8, 9])
    chunks = [Chunk(prefill, 3), Chunk(decoding, 1)]
    step = pack_step(chunks, allocator)
    assert step["input_ids"].tolist() == [7, 8, 9, 6]
    assert step["positions"].tolist() == [0, 1, 2, 5]
    assert step["seq_starts"].tolist() == [0, 3]
    assert step["query_lens"].tolist() == [3, 1]
    assert step["context_lens"].tolist() == [3, 6]
    assert step["logits_indices"].tolist() == [2, 3]
    table = decoding.table.blocks
    assert step["slot_mapping"][3] == table[1] * 4 + 1  # position 5: second block, offset 1
    assert step["block_tables"].shape == (2, 2)
    assert step["block_tables"][1].tolist() == table
    assert len(set(prefill.table.blocks) & set(table)) == 0, "two sequences never share a block"
    commit_step(chunks)
    assert (prefill.num_cached, decoding.num_cached) == (3, 6)


def test_all_logits_selects_every_row():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    step = pack_step([Chunk(Sequence(0, [1, 2, 3]), 3), Chunk(Sequence(1, [4, 5]), 2)], allocator, all_logits=True)
    assert step["logits_indices"].tolist() == [0, 1, 2, 3, 4]


def test_pool_exhaustion_and_release():
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    seq = Sequence(0, list(range(9)))
    with pytest.raises(OutOfBlocks, match="need 3 more KV blocks, 2 free of 2"):
        pack_step([Chunk(seq, 9)], allocator)
    seq = Sequence(1, list(range(8)))
    pack_step([Chunk(seq, 8)], allocator)
    assert allocator.num_free == 0
    allocator.release(seq.table)
    assert allocator.num_free == 2 and seq.table.blocks == []


def test_chunk_may_not_overrun_its_sequence():
    with pytest.raises(AssertionError, match="overruns sequence"):
        pack_step([Chunk(Sequence(0, [1, 2]), 3)], BlockAllocator(4, 4))
    assert np.int32 == pack_step([Chunk(Sequence(0, [1]), 1)], BlockAllocator(1, 4))["slot_mapping"].dtype
