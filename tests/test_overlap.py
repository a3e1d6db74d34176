"""Async scheduling (runtime/overlap.py) on the reference engine: the next step is launched before the tokens of
the one in flight are read, its pending tokens filled from that step's draws, and every request gets the tokens,
logprobs and finish reasons the plain steps give (sampling, stops learnt a step late, chunked prefill, admissions,
prefix hits, preemption, aborts, a draw the device left unresolved; and over seeded random loads), on a dense model
and on a recurrent one (state snapshots copied at launch); the GPU engine's device copies of pending tokens and its
downloads; an embedding of an id outside the table reads zeros."""

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pegainfer.frontends.load import load_model
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.gpu import engine as gpu_engine
from pegainfer.runtime.pending_tokens import PENDING, copy_runs, pending_rows
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler

from overlap_runs import assert_same, run

GREEDY = SamplingParams(max_tokens=7, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def hybrid(checkpoint_factory):
    return load_model(checkpoint_factory("qwen3_5_hybrid"))


def mixed_requests(count: int = 7) -> list[EngineRequest]:
    """Prompts of several lengths (two sharing a prefix), greedy and seeded sampling, top-k, top-p (whose kept set
    may reach past the tail's candidates: drawn on the host), logprobs, and max_tokens of each request's own."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 500, 40).tolist()
    kinds = [GREEDY, SamplingParams(temperature=1.0, seed=5, max_tokens=9, ignore_eos=True),
             SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=5, logprobs=2, ignore_eos=True),
             replace(GREEDY, max_tokens=12), SamplingParams(temperature=0.9, top_p=0.8, seed=4, max_tokens=8)]
    return [EngineRequest(f"r{i}", (prefix if i < 2 else []) + rng.integers(0, 500, int(rng.integers(2, 30))).tolist(),
                          kinds[i % len(kinds)]) for i in range(count)]


def test_async_steps_give_the_plain_steps_tokens_and_launch_ahead(model):
    requests = mixed_requests()
    plain, _, plain_engine = run(model, requests, overlap=False, prefix_cache=True)
    ahead, scheduler, engine = run(model, requests, overlap=True, prefix_cache=True)
    assert_same(ahead, plain)
    assert plain_engine.overlapped() == 0
    assert engine.overlapped() >= 10, engine.log  # decode steps went ahead of the reads
    assert scheduler.cache.hits > 0  # the shared prefix was hit by a request admitted ahead


def test_a_stop_learnt_a_step_late_ends_the_request_where_the_plain_steps_do(model):
    requests = [replace(r, params=replace(r.params, ignore_eos=False)) for r in mixed_requests(5)]
    plain, _, _ = run(model, requests, overlap=False)
    eos = frozenset({plain["r0"][2][0], plain["r3"][4][0]})  # tokens drawn mid-way become ends of sequence
    plain, _, _ = run(model, requests, overlap=False, eos=eos)
    ahead, _, engine = run(model, requests, overlap=True, eos=eos)
    assert_same(ahead, plain)
    assert engine.overlapped() > 0
    assert [o[1] for o in ahead["r0"]] == [None, None, "stop"]


def test_requests_that_cannot_overlap_run_plain_steps(model):
    """A request wanting prompt logprobs is scored apart: while it runs (the longest), no step goes ahead of a read."""
    scored = replace(GREEDY, prompt_logprobs=1, max_tokens=20)
    requests = [EngineRequest("scored", [5, 6, 7, 8], scored), *mixed_requests(3)]
    plain, _, _ = run(model, requests, overlap=False, max_num_seqs=8)
    ahead, scheduler, engine = run(model, requests, overlap=True, max_num_seqs=8)
    assert_same(ahead, plain)
    assert engine.overlapped() == 0  # admitted first, the scored one held every step plain


def test_an_engine_whose_steps_others_follow_runs_plain_steps(model):
    """A sharded GPU engine's workers get the packed step, not the draws copied on rank 0's device."""
    from pegainfer.runtime.gpu.sharded import ShardedGpuEngine

    assert not ShardedGpuEngine.overlaps
    requests = mixed_requests(3)
    plain, _, _ = run(model, requests, overlap=False)
    ahead, scheduler, engine = run(model, requests, overlap=True, engine_overlaps=False)
    assert_same(ahead, plain)
    assert scheduler.overlap is None and engine.overlapped() == 0


def test_preemption_waits_for_the_step_in_flight(model):
    requests = [EngineRequest(f"r{i}", list(range(10 + i, 40 + i)), replace(GREEDY, max_tokens=20)) for i in range(4)]
    plain, scheduler, _ = run(model, requests, overlap=False, kv_tokens=112)
    assert scheduler.stats.preemptions > 0
    ahead, scheduler, engine = run(model, requests, overlap=True, kv_tokens=112)
    assert_same(ahead, plain)
    assert scheduler.stats.preemptions > 0 and engine.overlapped() > 0


def test_an_abort_while_a_step_is_in_flight_frees_the_request_and_spares_the_others(model):
    requests = mixed_requests(4)
    plain, _, _ = run(model, requests, overlap=False, max_num_seqs=8)
    ahead, scheduler, engine = run(model, requests, overlap=True, max_num_seqs=8, abort=("r3", 4))
    assert engine.overlapped() > 0
    assert_same({k: v for k, v in ahead.items() if k != "r3"}, {k: v for k, v in plain.items() if k != "r3"})
    assert_same({"r3": ahead["r3"]}, {"r3": plain["r3"][:len(ahead["r3"])]})
    assert len(ahead["r3"]) < len(plain["r3"])  # and run() saw no block in use at the end


def test_a_draw_left_unresolved_is_rolled_back_and_drawn_again_in_plain_steps(model):
    """The rolled-back request's steps are plain from then on: each launch read before the next, to its end."""
    requests = mixed_requests(3)
    plain, _, _ = run(model, requests, overlap=False, max_num_seqs=8)
    ahead, _, engine = run(model, requests, overlap=True, max_num_seqs=8, unresolve=frozenset({3}))
    assert_same(ahead, plain)
    after = engine.log.index(("read", 3))
    assert engine.overlapped() > 0 and engine.log[after + 1] == ("read", 4)  # the one in flight, then plain steps
    assert all(kind == ("launch" if i % 2 == 0 else "read") for i, (kind, _) in enumerate(engine.log[after + 2:]))


def random_requests(rng: np.random.Generator, count: int, max_model_len: int) -> list[EngineRequest]:
    prefix = rng.integers(0, 500, int(rng.integers(10, 50))).tolist()
    kinds = [GREEDY, SamplingParams(temperature=1.0, seed=int(rng.integers(0, 100))),
             SamplingParams(temperature=0.8, top_k=5, seed=3, logprobs=2)]
    requests = []
    for i in range(count):
        params = replace(kinds[int(rng.integers(0, 3))], max_tokens=int(rng.integers(1, 15)),
                         ignore_eos=bool(rng.integers(0, 2)))
        prompt = (prefix if rng.integers(0, 2) else []) + rng.integers(0, 500, int(rng.integers(1, 40))).tolist()
        requests.append(EngineRequest(f"r{i}", prompt[:max_model_len - 2], params))
    return requests


@pytest.mark.parametrize("kind, seed", [("model", s) for s in range(12)] + [("hybrid", s) for s in range(4)])
def test_random_loads_give_the_plain_steps_tokens_and_never_hash_a_pending_token(request, kind, seed):
    """Random prompts (some sharing a prefix), sampling, max_tokens, stops on a token drawn early, context limits,
    pools small enough to preempt, the prefix cache on or off, an abort and an unresolved draw: the same tokens and
    finish reasons as plain steps; after every step each PENDING token is one the sequence waits for, and no cached
    block's tokens hold one. On the dense model and on a recurrent one (state snapshots at launch)."""
    model = request.getfixturevalue(kind)
    rng = np.random.default_rng(seed)
    config = dict(prefix_cache=bool(rng.integers(0, 2)), max_model_len=int(rng.integers(30, 80)),
                  max_num_seqs=int(rng.integers(1, 5)), kv_tokens=int(rng.choice([4096, 160])))
    requests = random_requests(rng, int(rng.integers(2, 8)), config["max_model_len"])
    plain, _, _ = run(model, requests, overlap=False, **config)
    eos = frozenset(v[1][0] for v in plain.values() if len(v) > 1)
    plain, _, _ = run(model, requests, overlap=False, eos=eos, **config)

    def check(scheduler: Scheduler) -> None:
        for state in scheduler.running:
            tokens = state.seq.token_ids
            assert [i for i, t in enumerate(tokens) if t == PENDING] == [i for i, _ in state.pending]
            assert PENDING not in tokens[:len(state.block_hashes) * scheduler.block_size]
    aborted = f"r{int(rng.integers(0, len(requests)))}"
    ahead, _, _ = run(model, requests, overlap=True, eos=eos, check=check, abort=(aborted, int(rng.integers(1, 8))),
                      unresolve=frozenset({int(rng.integers(2, 6))}), **config)
    atol = 5e-4 if kind == "hybrid" else 1e-4  # a rolled-back recurrent sequence is recomputed in other chunks
    assert_same({k: v for k, v in ahead.items() if k != aborted}, {k: v for k, v in plain.items() if k != aborted},
                atol)
    assert_same({aborted: ahead[aborted]}, {aborted: plain[aborted][:len(ahead[aborted])]}, atol)


def test_a_recurrent_model_goes_ahead_and_its_snapshots_taken_at_launch_serve_prefix_hits(hybrid):
    """Qwen3.5's layers keep a state row a sequence, moved on by the next step before this one is read: a snapshot
    at a block boundary is copied as the step ending there is launched and named at its read. One sequence at a
    time, so the second request hits the first one's prefix in both ways."""
    prefix = list(range(100, 150))
    requests = [EngineRequest("a", prefix + [7, 8, 9], replace(GREEDY, max_tokens=20)),
                EngineRequest("b", prefix + [3], SamplingParams(temperature=1.0, seed=2, max_tokens=9))]
    plain, plain_scheduler, _ = run(hybrid, requests, overlap=False, max_num_seqs=1)
    ahead, scheduler, engine = run(hybrid, requests, overlap=True, max_num_seqs=1)
    assert_same(ahead, plain)
    assert engine.overlapped() >= 10 and scheduler.overlap is not None
    assert scheduler.snapshots.taken == plain_scheduler.snapshots.taken >= 3
    assert scheduler.snapshots.restored == plain_scheduler.snapshots.restored == 1
    assert ahead["b"] and scheduler.stats.prompt_tokens > 0


def test_a_recurrent_sequence_rolled_back_is_recomputed(hybrid):
    """Its state has run the rows after the unresolved draw: it is preempted and recomputed from its tokens."""
    requests = mixed_requests(3)
    plain, _, _ = run(hybrid, requests, overlap=False, max_num_seqs=8)
    ahead, scheduler, _ = run(hybrid, requests, overlap=True, max_num_seqs=8, unresolve=frozenset({3}))
    assert_same(ahead, plain)
    assert scheduler.stats.preemptions == 1


def test_pending_rows_pair_each_pending_decode_row_with_its_draw():
    seqs = [Sequence(0, [1, 2, PENDING], num_cached=2), Sequence(1, [4, 5, 6, 7], num_cached=1),
            Sequence(2, [8, PENDING], num_cached=1), Sequence(3, [9, PENDING], num_cached=1)]
    chunks = [Chunk(seqs[0], 1), Chunk(seqs[2], 1), Chunk(seqs[3], 1), Chunk(seqs[1], 3)]
    pairs = pending_rows(chunks, np.array([0, 1, 2, 3]), {0: 4, 2: 5, 3: 7})
    assert pairs == [(0, 4), (1, 5), (2, 7)]
    assert copy_runs(pairs) == [(0, 4, 2), (2, 7, 1)]
    with pytest.raises(AssertionError, match="sequence 2: a pending token"):
        pending_rows(chunks[1:2], np.array([0]), {})


def test_the_gpu_engine_copies_pending_tokens_after_the_upload(monkeypatch):
    calls = []
    executor = SimpleNamespace(input_region=0x1000, inputs={"input_ids": (256, None)},
                               upload_step=lambda step: calls.append("upload") or {"tokens": 4})
    drawn = SimpleNamespace(ptr=0x9000, dtype=np.dtype(np.int32))
    engine = SimpleNamespace(executor=executor, drawn=({}, drawn), ctx=SimpleNamespace(stream=7))
    monkeypatch.setattr(gpu_engine.driver, "copy_on_device",
                        lambda dst, src, nbytes, stream: calls.append((dst, src, nbytes, stream)))
    assert gpu_engine.GpuEngine._upload(engine, {}, [(0, 4, 2), (3, 7, 1)]) == {"tokens": 4}
    assert calls == ["upload", (0x1000 + 256, 0x9000 + 16, 8, 7), (0x1000 + 256 + 12, 0x9000 + 28, 4, 7)]


def test_downloads_past_the_landing_area_are_read_before_a_later_step_can_overwrite_them(monkeypatch):
    from pegainfer.ir.dtypes import INT32
    from pegainfer.runtime.gpu import downloads
    from pegainfer.runtime.gpu.abi import DeviceTensor
    from pegainfer.runtime.gpu.staging import PinnedPair

    monkeypatch.setattr(downloads.driver, "alloc_pinned", lambda n: np.zeros(n, np.uint8))
    monkeypatch.setattr(downloads.driver, "Event", lambda timing=True: SimpleNamespace(record=lambda stream: None))
    values = {0x1000: np.arange(300, dtype=np.int32)}  # the device's buffer, as a later step will rewrite it
    monkeypatch.setattr(downloads, "fetch", lambda ctx, t: values[t.ptr].copy())
    tensor = DeviceTensor.contiguous(0x1000, (300,), INT32)
    read = downloads.fetch_later(SimpleNamespace(stream=0), PinnedPair(512), [tensor])
    values[0x1000][:] = -1  # the next step ran before the read
    np.testing.assert_array_equal(read()[0], np.arange(300))


def test_an_embedding_of_an_id_outside_the_table_reads_zeros():
    from pegainfer.backends.triton.kernels.embedding import embedding_kernel
    from pegainfer.ir.registry import get_op

    table = torch.arange(40, dtype=torch.float32).reshape(10, 4) + 1
    ids = torch.tensor([3, -1, 9, 10], dtype=torch.int32)
    out = torch.full((4, 4), 5.0)
    embedding_kernel[(4, 1)](ids, table, out, 4, HIDDEN=4, BLOCK=4, SCALE=1.0, FIRST_ID=-1, ROWS=10, PDL=False)
    expected = np.concatenate([table[[3]].numpy(), np.zeros((1, 4), np.float32), table[[9]].numpy(),
                               np.zeros((1, 4), np.float32)])
    np.testing.assert_array_equal(out.numpy(), expected)
    np.testing.assert_array_equal(get_op("embedding").reference(ids.numpy(), table.numpy()), expected)
