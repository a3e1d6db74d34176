"""The prefix cache: hash chains, reference counts and LRU eviction on a bare pool; and through the scheduler, a
shared prefix is computed once and changes no output."""

from dataclasses import replace

import numpy as np
import pytest

from pegainfer.frontends.load import load_model
from pegainfer.runtime.kv_blocks import BlockAllocator, BlockTable
from pegainfer.runtime.prefix_cache import PrefixCache, chain_hashes
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

BS = 4


def test_chain_hashes_cover_full_blocks_and_everything_before_them():
    a = chain_hashes(list(range(10)), BS)
    assert len(a) == 2  # the last 2 tokens are not a full block
    assert chain_hashes(list(range(8)), BS) == a
    changed_first = chain_hashes([99, *range(1, 10)], BS)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # block 1's tokens are equal, its parent is not
    changed_second = chain_hashes([*range(7), 99], BS)
    assert changed_second[0] == a[0] and changed_second[1] != a[1]
    assert chain_hashes(list(range(10)), BS, a[0], 1, 2) == a[1:]


def cache_with_sequence(tokens: list[int], num_blocks: int = 8) -> tuple[PrefixCache, BlockAllocator, BlockTable]:
    allocator = BlockAllocator(num_blocks, BS)
    cache = PrefixCache(allocator)
    table = BlockTable()
    allocator.grow(table, len(tokens))
    for block, block_hash in zip(table.blocks, chain_hashes(tokens, BS)):
        cache.insert(block, block_hash)
    return cache, allocator, table


def test_lookup_finds_the_longest_cached_prefix_and_takes_nothing():
    tokens = list(range(12))
    cache, allocator, table = cache_with_sequence(tokens)
    blocks, hashes = cache.lookup([*range(8), 50, 51, 52, 53, 54], max_blocks=10)
    assert blocks == table.blocks[:2] and hashes == chain_hashes(tokens, BS)[:2]
    assert cache.lookup(tokens, max_blocks=1)[0] == table.blocks[:1]
    assert cache.lookup([5, *tokens[1:]], max_blocks=10) == ([], [])
    assert cache.num_evictable == 0  # lookup took no reference; the writer still holds all three


def test_reference_counts_and_lru_eviction():
    tokens = list(range(12))
    cache, allocator, table = cache_with_sequence(tokens)
    assert allocator.num_free == 5
    reader = cache.lookup(tokens, max_blocks=2)[0]
    cache.acquire(reader)
    assert cache.release(table.blocks) == []  # every block of the writer is cached: nothing of its own to free
    assert cache.num_evictable == 1  # block 2 only; blocks 0 and 1 are still held by the reader
    assert cache.release(reader) == []
    assert cache.num_evictable == 3
    # released last block first: the tail of a prefix goes before its head
    assert cache.evict(1) == 1 and cache.lookup(tokens, 3)[0] == table.blocks[:2]
    assert allocator.num_free == 6
    again = cache.lookup(tokens, 3)[0]
    cache.acquire(again)  # a hit makes the blocks referenced again: not evictable
    assert cache.num_evictable == 0 and cache.evict(5) == 0
    cache.release(again)
    assert cache.evict(5) == 2 and allocator.num_free == 8 and cache.num_cached == 0
    assert cache.lookup(tokens, 3) == ([], [])


def test_a_block_already_cached_under_another_id_stays_private():
    tokens = list(range(8))
    cache, allocator, first = cache_with_sequence(tokens)
    second = BlockTable()
    allocator.grow(second, 8)
    for block, block_hash in zip(second.blocks, chain_hashes(tokens, BS)):
        cache.insert(block, block_hash)
    assert cache.num_cached == 2
    assert cache.release(second.blocks) == second.blocks  # its own copies: freed, not cached


# --- through the scheduler ---------------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


def serve(scheduler: Scheduler, request: EngineRequest) -> list[int]:
    scheduler.add(request)
    out = []
    while scheduler.has_work():
        out += [o.token_id for o in scheduler.step()]
    return out


def test_a_shared_prefix_is_computed_once_with_the_same_outputs(model):
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 500, 70).tolist()  # 4 full blocks of 16 and 6 tokens
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    cold = Scheduler(ReferenceEngine(model, max_tokens=1024), frozenset(), SchedulerConfig(prefix_cache=False))
    expected = [serve(cold, EngineRequest("a", first, GREEDY)), serve(cold, EngineRequest("b", second, GREEDY))]
    scheduler = Scheduler(ReferenceEngine(model, max_tokens=1024), frozenset(), SchedulerConfig())
    assert serve(scheduler, EngineRequest("a", first, GREEDY)) == expected[0]
    computed = scheduler.stats.prefill_tokens
    assert computed == len(first)
    assert serve(scheduler, EngineRequest("b", second, GREEDY)) == expected[1]
    assert scheduler.stats.prefill_tokens - computed == len(second) - 64
    assert scheduler.cache.hits == 64 and scheduler.cache.queries == len(first) + len(second)
    assert scheduler.blocks_in_use == 0


def test_a_hit_leaves_at_least_one_prompt_token_to_compute(model):
    prompt = list(range(1, 33))  # exactly two blocks
    scheduler = Scheduler(ReferenceEngine(model, max_tokens=1024), frozenset(), SchedulerConfig())
    first = serve(scheduler, EngineRequest("a", prompt, GREEDY))
    before = scheduler.stats.prefill_tokens
    assert serve(scheduler, EngineRequest("b", prompt, GREEDY)) == first
    assert scheduler.stats.prefill_tokens - before == 16  # the second block is recomputed for its logits


def test_concurrent_sharers_and_eviction_under_pressure_keep_outputs(model):
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 500, 40).tolist()
    batch = [prefix + rng.integers(0, 500, int(n)).tolist() for n in rng.integers(1, 30, 8)]
    params = replace(GREEDY, max_tokens=12)
    reference = Scheduler(ReferenceEngine(model, max_tokens=4096), frozenset(), SchedulerConfig(prefix_cache=False))
    expected = [serve(reference, EngineRequest(f"r{i}", ids, params)) for i, ids in enumerate(batch)]
    # 12 blocks: the sequences do not all fit at once, cached blocks must be evicted and sequences preempted
    scheduler = Scheduler(ReferenceEngine(model, max_tokens=192), frozenset(),
                          SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8))
    for i, ids in enumerate(batch):
        scheduler.add(EngineRequest(f"r{i}", ids, params))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    while scheduler.has_work():
        for out in scheduler.step():
            got[out.request_id].append(out.token_id)
        assert scheduler.allocator.num_free + scheduler.cache.num_evictable + scheduler.blocks_in_use == 12
    assert list(got.values()) == expected
    assert scheduler.cache.hits > 0 and scheduler.cache.evictions > 0 and scheduler.stats.preemptions > 0
    assert scheduler.blocks_in_use == 0


def test_num_cached_tokens_is_reported_on_outputs(model):
    prompt = list(range(100, 150))
    scheduler = Scheduler(ReferenceEngine(model, max_tokens=1024), frozenset(), SchedulerConfig())
    scheduler.add(EngineRequest("a", prompt, replace(GREEDY, max_tokens=1)))
    assert first_output(scheduler).num_cached_tokens == 0
    scheduler.add(EngineRequest("b", prompt, replace(GREEDY, max_tokens=1)))
    assert first_output(scheduler).num_cached_tokens == 48


def first_output(scheduler: Scheduler):
    """The next token out (with async scheduling a step's tokens come out of the step() call after it)."""
    for _ in range(4):
        if outputs := scheduler.step():
            return outputs[0]
    raise AssertionError("no token after 4 steps")
