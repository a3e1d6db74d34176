"""The prefix cache of a model with recurrent layers (Qwen3.5): its state snapshotted at cached block boundaries, a
prefix hit restoring it, with the tokens and logprobs of a cold run; snapshot rows reused LRU and dropped with their
blocks; prompt chunks cut to end on block boundaries; and the server's ready line and cached tokens."""

import json
from dataclasses import replace

import numpy as np
import pytest

from live_server import KEY, NAME, start_server, stop_server
from pegainfer.cli import main
from pegainfer.frontends.load import load_model
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest, TokenOutput
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig
from pegainfer.runtime.state_snapshots import StateSnapshots, chunk_to_boundary

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
BLOCK = 16


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return load_model(checkpoint_factory("qwen3_5_hybrid"))


def tokens(count: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, count).tolist()


def serve(model, state_snapshots: int | None = None, max_seqs: int = 8, **config) -> Scheduler:
    engine = ReferenceEngine(model, max_tokens=config.pop("max_tokens", 2048), max_seqs=max_seqs,
                             state_snapshots=state_snapshots)
    return Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=max_seqs, **config))


def run(scheduler: Scheduler, requests: list[EngineRequest], max_steps: int = 3000) -> dict[str, list[TokenOutput]]:
    for request in requests:
        scheduler.add(request)
    outputs: dict[str, list[TokenOutput]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not scheduler.has_work():
            return outputs
        for out in scheduler.step():
            outputs[out.request_id].append(out)
    raise AssertionError(f"not done after {max_steps} steps")


def cold(model, prompt: list[int], params: SamplingParams = GREEDY) -> list[TokenOutput]:
    return run(serve(model, prefix_cache=False), [EngineRequest("cold", prompt, params)])["cold"]


def assert_same(got: list[TokenOutput], expected: list[TokenOutput]) -> None:
    assert [o.token_id for o in got] == [o.token_id for o in expected]
    for a, b in zip(got, expected):  # the same state and KV, summed in other chunks: float32 rounding apart (as
        # test_recurrent_state.py finds for one prompt cut into chunks)
        assert a.logprobs.keys() == b.logprobs.keys()
        np.testing.assert_allclose(list(a.logprobs.values()), list(b.logprobs.values()), rtol=1e-5, atol=2e-4)


def test_a_prefix_hit_restores_the_state_and_gives_the_tokens_and_logprobs_of_a_cold_run(model):
    scheduler = serve(model)
    assert scheduler.prefix_cache_status() == "on (recurrent state kept at up to 8 block boundaries)"
    first = tokens(45, seed=1)
    run(scheduler, [EngineRequest("a", first, GREEDY)])
    # the prompt's chunks end at 32 (a snapshot there) and 45; decoding fills block 3 at 48 (another)
    assert scheduler.snapshots.taken == 2
    second = first[:40] + tokens(10, seed=2)
    out = run(scheduler, [EngineRequest("b", second, GREEDY)])["b"]
    assert out[0].num_cached_tokens == 32 and scheduler.snapshots.restored == 1
    assert_same(out, cold(model, second))


def test_a_conversation_turn_resumes_past_the_last_reply_from_its_snapshot(model):
    scheduler = serve(model)
    prompt = tokens(37, seed=3)
    reply = [o.token_id for o in run(scheduler, [EngineRequest("t1", prompt, replace(GREEDY, max_tokens=30))])["t1"]]
    # 66 tokens written (37 + 29 fed back): blocks 0..3 full; past the prompt only the snapshot at 64 stays
    turn = prompt + reply + tokens(9, seed=4)
    out = run(scheduler, [EngineRequest("t2", turn, GREEDY)])["t2"]
    assert out[0].num_cached_tokens == 64
    assert_same(out, cold(model, turn))


def test_a_hit_stops_at_the_deepest_boundary_with_a_snapshot(model):
    scheduler = serve(model, max_num_batched_tokens=24)  # chunks of 24 cut to 16: snapshots at 16, 32, 48
    prompt = tokens(60, seed=5)
    run(scheduler, [EngineRequest("a", prompt, replace(GREEDY, max_tokens=1))])
    hashes = [h for h in scheduler.cache._block_of if h in scheduler.snapshots]
    assert len(hashes) == 3
    scheduler.snapshots.drop(hashes[2])  # blocks 0..2 stay cached, the state at 48 does not
    longer = prompt[:55] + tokens(5, seed=6)
    out = run(scheduler, [EngineRequest("b", longer, GREEDY)])["b"]
    assert out[0].num_cached_tokens == 32
    assert_same(out, cold(model, longer))


def test_snapshots_go_with_evicted_blocks_and_rows_are_reused_least_recently_used_first(model):
    scheduler = serve(model, state_snapshots=2)
    prompts = [tokens(40, seed=10 + i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        run(scheduler, [EngineRequest(f"p{i}", prompt, replace(GREEDY, max_tokens=1))])
    assert scheduler.snapshots.num_stored == 2 and scheduler.snapshots.taken == 3  # one a prompt (at 32), two rows
    out = run(scheduler, [EngineRequest("again", prompts[0] + [1], replace(GREEDY, max_tokens=1))])["again"]
    assert out[0].num_cached_tokens == 0  # its snapshots were the least recently used: overwritten
    out = run(scheduler, [EngineRequest("last", prompts[2] + [1], GREEDY)])["last"]
    assert out[0].num_cached_tokens == 32
    scheduler.cache.clear()
    assert scheduler.snapshots.num_stored == 0 and scheduler.cache.num_cached == 0


def test_shared_prefixes_under_preemption_and_aborts_give_each_request_its_own_output(model):
    rng = np.random.default_rng(7)
    stems = [tokens(int(rng.integers(20, 50)), seed=20 + i) for i in range(3)]
    requests = []
    for i in range(24):
        stem = stems[int(rng.integers(0, 3))]
        prompt = stem[:int(rng.integers(len(stem) // 2, len(stem) + 1))] + tokens(int(rng.integers(1, 12)), 40 + i)
        requests.append(EngineRequest(f"r{i}", prompt, replace(GREEDY, max_tokens=int(rng.integers(2, 40)))))
    # 12 blocks for 6 sequences of up to 100 tokens, 4 snapshot rows: preemption, eviction and row reuse
    scheduler = serve(model, state_snapshots=4, max_seqs=6, max_tokens=12 * BLOCK, max_num_batched_tokens=40)
    for request in requests:
        scheduler.add(request)
    outputs: dict[str, list[TokenOutput]] = {r.request_id: [] for r in requests}
    for step in range(3000):
        if step == 15:
            for i in range(0, 24, 5):
                scheduler.abort(f"r{i}")
        if not scheduler.has_work():
            break
        for out in scheduler.step():
            outputs[out.request_id].append(out)
    assert not scheduler.has_work()
    assert scheduler.stats.preemptions > 0 and scheduler.snapshots.restored > 0
    for request in requests:
        if outputs[request.request_id] and outputs[request.request_id][-1].finish_reason:
            assert_same(outputs[request.request_id], cold(model, request.prompt_ids, request.params))
    allocator = scheduler.allocator
    assert allocator.num_free + scheduler.cache.num_evictable == allocator.num_blocks
    assert allocator.num_free_slots == allocator.state_slots


def test_the_pools_hold_the_snapshot_rows_beside_the_sequences(model):
    engine = ReferenceEngine(model, max_tokens=256, max_seqs=3, state_snapshots=5)
    allocator = engine.allocator
    assert allocator.state_slots == 3 and list(allocator.snapshot_rows) == [3, 4, 5, 6, 7]
    assert engine.pooled and all(engine.states[name].shape[0] == 8 for name in engine.pooled)
    engine.states[engine.pooled[0]][1] = 7.0
    engine.copy_state(1, 6)
    assert (engine.states[engine.pooled[0]][6] == 7.0).all()


def test_state_snapshots_take_free_rows_first_then_the_least_recently_used():
    snapshots = StateSnapshots(range(4, 6))

    def take(block_hash: bytes) -> int:
        row = snapshots.reserve()
        snapshots.name(row, block_hash)
        return row
    assert (take(b"a"), take(b"b")) == (4, 5)
    assert snapshots.restore(b"a") == 4  # now b is the least recently used
    assert take(b"c") == 5 and b"b" not in snapshots
    assert snapshots.deepest([b"x", b"a", b"y"]) == 2 and snapshots.deepest([b"y"]) == 0
    snapshots.drop(b"a")
    assert take(b"d") == 4


@pytest.mark.parametrize("start", [0, 5, 16, 31])
@pytest.mark.parametrize("count", [1, 7, 16, 27, 64])
def test_a_chunk_ends_on_the_last_block_boundary_it_crosses(start, count):
    length = chunk_to_boundary(start, count, BLOCK)
    crossed = [b for b in range(start + 1, start + count + 1) if b % BLOCK == 0]  # its end may be one
    assert 1 <= length <= count
    assert start + length == (crossed[-1] if crossed else start + count)


def test_the_server_says_the_prefix_cache_is_on_and_a_shared_prefix_is_served_from_it(checkpoint_factory, tmp_path,
                                                                                      capsys):
    checkpoint = checkpoint_factory("qwen3_5_hybrid")
    server = start_server(checkpoint, "--api-key", KEY, "--state-snapshots", "4", log=tmp_path / "serve.log")
    try:
        first = tokens(45, seed=30)
        server.client().completions.create(model=NAME, prompt=first, max_tokens=4, temperature=0)
        second = first[:40] + tokens(6, seed=31)
        result = server.client().completions.create(model=NAME, prompt=second, max_tokens=6, temperature=0,
                                                    extra_body={"ignore_eos": True})
    finally:
        stop_server(server)
    assert "prefix cache on (recurrent state kept at up to 4 block boundaries)" in server.log.read_text()
    assert result.usage.prompt_tokens_details.cached_tokens == 32
    assert main(["generate", "--model-path", str(checkpoint), "--json", "--device", "cpu", "--prompt-ids",
                 ",".join(map(str, second)), "--max-tokens", "6", "--ignore-eos"]) == 0
    assert result.choices[0].text == json.loads(capsys.readouterr().out)["text"]
