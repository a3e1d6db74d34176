"""A model with recurrent layers (Qwen3.5's linear attention) under the runtime: chunked prefill carries the state
across chunks, each running sequence holds one state slot, and preemption, abort and finish free it; without
rows for state snapshots the prefix cache is off for such a model, and the server says why."""

from dataclasses import replace

import numpy as np
import pytest

from pegainfer.frontends.load import load_model
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.generate import Request, generate
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import NO_PREFIX_CACHE_FOR_RECURRENT, Scheduler, SchedulerConfig

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("qwen3_5_hybrid"))


def prompts(count: int, seed: int, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 500, int(rng.integers(low, high))).tolist() for _ in range(count)]


def offline(model, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [generate(ReferenceEngine(model, max_tokens=512), [Request(ids, params)], frozenset())[0].token_ids
            for ids in prompt_ids]


def run_all(scheduler: Scheduler, requests: list[EngineRequest], max_steps: int = 3000) -> dict[str, list[int]]:
    for request in requests:
        scheduler.add(request)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not scheduler.has_work():
            return outputs
        for out in scheduler.step():
            outputs[out.request_id].append(out.token_id)
    raise AssertionError(f"not done after {max_steps} steps")


def all_free(scheduler: Scheduler) -> bool:
    allocator = scheduler.allocator
    cached = scheduler.cache.num_evictable if scheduler.cache else 0  # unreferenced prefix-cache blocks
    return allocator.num_free + cached == allocator.num_blocks and allocator.num_free_slots == allocator.state_slots


@pytest.mark.parametrize("cuts", [(1,), (5,), (16,), (17, 18), (3, 20, 31), tuple(range(1, 40))])
def test_a_prompt_cut_into_chunks_gives_the_logits_of_one_shot_prefill(model, cuts):
    prompt = prompts(1, seed=4, low=40, high=41)[0]
    whole = ReferenceEngine(model, max_tokens=256)
    expected = whole.step([Chunk(Sequence(0, list(prompt)), len(prompt))], all_logits=True)
    engine = ReferenceEngine(model, max_tokens=256)
    seq, rows = Sequence(0, list(prompt)), []
    for start, end in zip((0, *cuts), (*cuts, len(prompt))):
        rows.append(engine.step([Chunk(seq, end - start)], all_logits=True))
    np.testing.assert_allclose(np.concatenate(rows), expected, rtol=1e-5, atol=1e-4)  # float32 sums reordered


def test_chunked_prefill_and_preemption_keep_the_outputs_and_free_every_slot(model):
    batch = prompts(6, seed=2, low=20, high=30)
    # 12 blocks of 16 tokens and prompt chunks of at most 24 tokens: sequences are preempted and recomputed
    engine = ReferenceEngine(model, max_tokens=192, max_seqs=6)
    scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24))
    outputs = run_all(scheduler, [EngineRequest(f"r{i}", ids, replace(GREEDY, max_tokens=20))
                                  for i, ids in enumerate(batch)])
    assert scheduler.stats.preemptions > 0
    assert list(outputs.values()) == offline(model, batch, replace(GREEDY, max_tokens=20))
    assert all_free(scheduler)


def test_64_streams_with_half_aborted_midway_leave_every_slot_and_block_free(model):
    engine = ReferenceEngine(model, max_tokens=64 * 48, max_seqs=64)
    scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256))
    batch = prompts(64, seed=6, low=4, high=24)
    for i, ids in enumerate(batch):
        scheduler.add(EngineRequest(f"r{i}", ids, replace(GREEDY, max_tokens=200 if i % 2 else 6)))
    done: dict[str, list[int]] = {}
    for step in range(400):
        if step == 10:  # the long half leaves, running or waiting
            assert engine.allocator.num_free_slots < engine.allocator.state_slots
            for i in range(1, 64, 2):
                assert scheduler.abort(f"r{i}")
        for out in scheduler.step():
            done.setdefault(out.request_id, []).append(out.token_id)
        if not scheduler.has_work():
            break
    assert not scheduler.has_work() and all_free(scheduler)
    short = [f"r{i}" for i in range(0, 64, 2)]
    assert [done[r] for r in short] == offline(model, batch[0::2], replace(GREEDY, max_tokens=6))


def test_each_running_sequence_holds_a_slot_and_max_num_seqs_may_not_exceed_them(model):
    engine = ReferenceEngine(model, max_tokens=1024, max_seqs=4)
    with pytest.raises(ValueError, match=r"max_num_seqs \(8\) must be at most the engine's state slots \(4\)"):
        Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=8))
    scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=4))
    for i, ids in enumerate(prompts(6, seed=3)):
        scheduler.add(EngineRequest(f"r{i}", ids, GREEDY))
    scheduler.step()
    assert len(scheduler.running) == 4 and engine.allocator.num_free_slots == 0
    assert sorted(s.seq.table.state_slot for s in scheduler.running) == [0, 1, 2, 3]
    assert scheduler.abort("r0") and engine.allocator.num_free_slots == 1


def test_without_snapshot_rows_the_prefix_cache_is_off_with_its_reason(model):
    engine = ReferenceEngine(model, max_tokens=1024, max_seqs=8, state_snapshots=0)
    scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=8, prefix_cache=True))
    assert scheduler.cache is None
    assert scheduler.prefix_cache_status() == f"off ({NO_PREFIX_CACHE_FOR_RECURRENT})"
    prompt = prompts(1, seed=9, low=40, high=41)[0]
    first = run_all(scheduler, [EngineRequest("a", prompt, GREEDY)])["a"]
    second = run_all(scheduler, [EngineRequest("b", prompt, GREEDY)])["b"]
    assert first == second == offline(model, [prompt], GREEDY)[0]
    assert all_free(scheduler)
