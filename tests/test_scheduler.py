"""The continuous-batching scheduler on the reference engine: outputs equal offline generation whatever the
batching (chunked prefill, token budget, preemption and recompute), the KV pool is never over-committed, requests
that can never fit are refused with their numbers, aborts free blocks at once, admission is fair between groups;
and the engine loop's failure path."""

import threading
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from pegainfer.errors import RequestError
from pegainfer.frontends.load import load_model
from pegainfer.runtime.batch import Chunk
from pegainfer.runtime.engine_loop import EngineDead, EngineLoop
from pegainfer.runtime.generate import Request, generate
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


def prompts(count: int, seed: int = 0, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 500, int(rng.integers(low, high))).tolist() for _ in range(count)]


def offline(model, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Each prompt alone through runtime.generate: the outputs batching must not change."""
    params = params if isinstance(params, list) else [params] * len(prompt_ids)
    return [generate(ReferenceEngine(model, max_tokens=256), [Request(ids, p)], frozenset())[0].token_ids
            for ids, p in zip(prompt_ids, params)]


class Recorder:
    """Wraps an engine: records each step's chunks and the pool's state, and checks no step over-commits."""

    def __init__(self, engine) -> None:
        self.engine, self.allocator, self.steps = engine, engine.allocator, []

    def sample(self, chunks: list[Chunk], params, token_index, constraints=None, launched=None):
        need = sum(self.allocator.blocks_for(c.seq.num_cached + c.num_tokens) - len(c.seq.table.blocks)
                   for c in chunks)
        self.steps.append({"tokens": [c.num_tokens for c in chunks], "free": self.allocator.num_free, "need": need})
        assert need <= self.allocator.num_free, f"step needs {need} blocks, {self.allocator.num_free} free"
        return self.engine.sample(chunks, params, token_index, launched=launched)

    def step(self, chunks: list[Chunk], *, all_logits: bool = False):
        return self.engine.step(chunks, all_logits=all_logits)

    def release(self, seq) -> None:
        self.engine.release(seq)


def run_all(scheduler: Scheduler, requests: list[EngineRequest], max_steps: int = 2000) -> dict[str, list]:
    for request in requests:
        scheduler.add(request)
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not scheduler.has_work():
            return outputs
        for out in scheduler.step():
            outputs[out.request_id].append(out)
        assert scheduler.blocks_in_use <= scheduler.allocator.num_blocks
    raise AssertionError(f"not done after {max_steps} steps")


def make(model, *, kv_tokens: int = 4096, **config) -> tuple[Scheduler, Recorder]:
    engine = Recorder(ReferenceEngine(model, max_tokens=kv_tokens))
    return Scheduler(engine, frozenset(), SchedulerConfig(**{"prefix_cache": False, **config})), engine


def requests_for(prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[EngineRequest]:
    params = params if isinstance(params, list) else [params] * len(prompt_ids)
    return [EngineRequest(f"r{i}", ids, p) for i, (ids, p) in enumerate(zip(prompt_ids, params))]


def tokens(outputs: dict[str, list]) -> list[list[int]]:
    return [[o.token_id for o in outs] for outs in outputs.values()]


def test_chunked_prefill_under_a_token_budget_equals_offline(model):
    batch = prompts(6, seed=1)
    scheduler, engine = make(model, max_num_batched_tokens=24, max_num_seqs=4)
    outputs = run_all(scheduler, requests_for(batch, GREEDY))
    assert tokens(outputs) == offline(model, batch, GREEDY)
    assert max(sum(s["tokens"]) for s in engine.steps) <= 24
    assert max(len(s["tokens"]) for s in engine.steps) <= 4
    # prompts longer than the budget were split, and some step mixed decode tokens with a prompt chunk
    assert any(max(s["tokens"]) > 1 and 1 in s["tokens"] for s in engine.steps), engine.steps
    for outs in outputs.values():
        assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    assert scheduler.blocks_in_use == 0 and scheduler.allocator.num_free == scheduler.allocator.num_blocks


def test_decode_tokens_are_scheduled_before_prompt_chunks(model):
    scheduler, engine = make(model, max_num_batched_tokens=8, max_num_seqs=8)
    scheduler.add(EngineRequest("short", [1, 2, 3], replace(GREEDY, max_tokens=30)))
    scheduler.step()  # the short prompt is prefilled and starts decoding
    scheduler.add(EngineRequest("long", list(range(5, 45)), GREEDY))
    for _ in range(4):
        scheduler.step()
    # each step: the decoding sequence's one token first, then 7 tokens of the 40-token prompt
    assert [s["tokens"] for s in engine.steps[1:5]] == [[1, 7]] * 4


def test_preemption_under_kv_pressure_recomputes_and_keeps_outputs(model):
    batch = prompts(6, seed=2, low=20, high=30)
    params = [replace(GREEDY, max_tokens=20) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True) for i in range(6)]
    # 10 blocks of 16 tokens: a sequence needs 3 at its end, six of them cannot all stay resident
    scheduler, engine = make(model, kv_tokens=160, max_num_batched_tokens=64, max_num_seqs=64)
    outputs = run_all(scheduler, requests_for(batch, params))
    assert scheduler.stats.preemptions > 0
    assert tokens(outputs) == offline(model, batch, params)
    assert scheduler.blocks_in_use == 0 and scheduler.allocator.num_free == 10


def test_the_newest_running_sequence_is_preempted(model):
    scheduler, _ = make(model, kv_tokens=96, max_num_batched_tokens=256)  # 6 blocks
    old = EngineRequest("old", list(range(1, 30)), replace(GREEDY, max_tokens=60))
    new = EngineRequest("new", list(range(40, 69)), replace(GREEDY, max_tokens=60))
    scheduler.add(old)
    scheduler.add(new)
    scheduler.step()
    assert [s.request.request_id for s in scheduler.running] == ["old", "new"]
    while scheduler.stats.preemptions == 0:
        scheduler.step()
    assert [s.request.request_id for s in scheduler.running] == ["old"]
    assert [s.request.request_id for s in scheduler.waiting] == ["new"]
    assert scheduler.waiting[0].seq.num_cached == 0 and not scheduler.waiting[0].seq.table.blocks


def test_a_request_that_cannot_fit_yet_waits(model):
    scheduler, _ = make(model, kv_tokens=64, max_num_batched_tokens=256)  # 4 blocks
    scheduler.add(EngineRequest("a", list(range(1, 40)), replace(GREEDY, max_tokens=4)))  # 3 blocks
    scheduler.add(EngineRequest("b", list(range(50, 80)), replace(GREEDY, max_tokens=4)))  # 2 blocks
    scheduler.step()
    assert [s.request.request_id for s in scheduler.running] == ["a"]
    assert [s.request.request_id for s in scheduler.waiting] == ["b"]
    done = {}
    while scheduler.has_work():
        for out in scheduler.step():
            done.setdefault(out.request_id, []).append(out.token_id)
    assert list(done) == ["a", "b"] and scheduler.stats.preemptions == 0


def late_request_admission(model, group: str | None) -> tuple[int, int, list[str]]:
    """Ten requests of `group` fill 4 slots (the first finishes alone, at step 3), then one 4-token request of
    another group arrives: the step at which a slot frees, the step after which it runs, who waits then."""
    scheduler, _ = make(model, max_num_seqs=4, max_num_batched_tokens=64)
    for i, max_tokens in enumerate([3] + [9] * 9):
        scheduler.add(EngineRequest(f"a{i}", [1 + i, 2, 3], replace(GREEDY, max_tokens=max_tokens), group=group))
    scheduler.step()
    assert [s.request.request_id for s in scheduler.running] == ["a0", "a1", "a2", "a3"]
    scheduler.add(EngineRequest("b", [7, 8, 9], replace(GREEDY, max_tokens=4), group="late"))
    freed = None
    for step in range(2, 200):
        finished = [o.request_id for o in scheduler.step() if o.finish_reason]
        freed = freed or (step if finished else None)
        if any(s.request.request_id == "b" for s in scheduler.running):
            return freed, step, [s.request.request_id for s in scheduler.waiting]
    raise AssertionError("b never ran")


def test_a_new_group_is_admitted_at_the_first_step_after_a_slot_frees(model):
    freed, admitted, waiting = late_request_admission(model, group="big")
    assert (freed, admitted) == (3, 4)
    assert waiting == [f"a{i}" for i in range(4, 10)]  # b took the freed slot; the big group's requests still wait
    freed, admitted, _ = late_request_admission(model, group=None)  # ten separate requests: b is eleventh in line
    assert freed == 3 and admitted > 10


def test_admission_takes_the_group_with_fewest_running_then_the_oldest(model):
    scheduler, _ = make(model, max_num_seqs=3)
    for name, group in [("x0", "x"), ("x1", "x"), ("x2", "x"), ("y0", "y"), ("y1", "y")]:
        scheduler.add(EngineRequest(name, [1, 2, 3], GREEDY, group=group))
    assert [s.request.request_id for s in scheduler.waiting] == ["x0", "x1", "x2", "y0", "y1"]
    assert scheduler.abort("x1")  # a waiting group's head leaves: x2 is next of its group
    scheduler.step()
    # x0 (both groups idle, x0 older), y0 (y runs none, x one), x2 (one each, x2 older than y1)
    assert [s.request.request_id for s in scheduler.running] == ["x0", "y0", "x2"]
    assert [s.request.request_id for s in scheduler.waiting] == ["y1"] and len(scheduler.waiting) == 1


def test_a_preempted_sequence_resumes_before_a_less_busy_group(model):
    scheduler, _ = make(model, kv_tokens=96, max_num_batched_tokens=256)  # 6 blocks
    for name in ("g0", "g1"):
        scheduler.add(EngineRequest(name, list(range(1, 30)), replace(GREEDY, max_tokens=60), group="g"))
    scheduler.step()
    while scheduler.stats.preemptions == 0:
        scheduler.step()
    assert [s.request.request_id for s in scheduler.waiting] == ["g1"]  # g still runs g0, so g weighs one
    scheduler.add(EngineRequest("z", [1, 2, 3], replace(GREEDY, max_tokens=2), group="z"))  # fits in one block
    order = []
    while scheduler.has_work():
        scheduler.step()
        order += [s.request.request_id for s in scheduler.running if s.request.request_id not in order]
    assert order == ["g0", "g1", "z"]  # z waited behind g1 although a block was free for it earlier


def test_first_scheduled_survives_preemption_and_steps_are_counted_by_tokens(model):
    scheduler, engine = make(model, kv_tokens=96, max_num_batched_tokens=256)
    old = EngineRequest("old", list(range(1, 30)), replace(GREEDY, max_tokens=60))
    new = EngineRequest("new", list(range(40, 69)), replace(GREEDY, max_tokens=60))
    scheduler.add(old)
    scheduler.add(new)
    outputs: dict[str, list] = {"old": [], "new": []}
    for out in scheduler.step():
        outputs[out.request_id].append(out)
    after_first_step = time.monotonic()
    while scheduler.has_work():
        for out in scheduler.step():
            outputs[out.request_id].append(out)
    assert scheduler.stats.preemptions > 0
    for request in (old, new):
        outs = outputs[request.request_id]
        assert len(outs) == 60 and len({o.first_scheduled for o in outs}) == 1
        assert request.arrival <= outs[0].first_scheduled <= outs[0].time <= after_first_step
    tokens_per_step = [sum(s["tokens"]) for s in engine.steps]
    assert scheduler.stats.step_tokens == Counter(tokens_per_step)
    assert sum(scheduler.stats.step_tokens.values()) == scheduler.stats.steps


def test_the_token_budget_must_hold_a_decode_token_of_every_sequence(model):
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(8\\) must be at least max_num_seqs \\(9\\)"):
        make(model, max_num_batched_tokens=8, max_num_seqs=9)


def test_a_request_that_can_never_fit_is_refused_with_its_numbers(model):
    scheduler, _ = make(model, kv_tokens=64, max_model_len=1000)
    with pytest.raises(RequestError) as error:
        scheduler.add(EngineRequest("big", list(range(1, 60)), replace(GREEDY, max_tokens=20)))
    message = str(error.value)
    assert "5 KV blocks" in message and "59 prompt + 20 generated" in message and "4 blocks" in message
    with pytest.raises(RequestError, match="at most 999"):
        scheduler.check(1000, 1)
    assert not scheduler.has_work()


def test_max_model_len_ends_a_sequence_with_length(model):
    scheduler, _ = make(model, max_model_len=12)
    outputs = run_all(scheduler, [EngineRequest("r", list(range(1, 9)), replace(GREEDY, max_tokens=100))])
    assert len(outputs["r"]) == 4 and outputs["r"][-1].finish_reason == "length"


def test_eos_and_stop_token_ids_finish_with_stop(model):
    expected = offline(model, [[7, 8, 9]], GREEDY)[0]
    eos = expected[2]
    engine = ReferenceEngine(model, max_tokens=512)
    scheduler = Scheduler(engine, frozenset([eos]), SchedulerConfig())
    outs = run_all(scheduler, [EngineRequest("eos", [7, 8, 9], replace(GREEDY, ignore_eos=False)),
                               EngineRequest("ignored", [7, 8, 9], GREEDY),
                               EngineRequest("stop_id", [7, 8, 9], GREEDY, stop_token_ids=frozenset([expected[1]]))])
    assert [o.token_id for o in outs["eos"]] == expected[: expected.index(eos) + 1]
    assert outs["eos"][-1].finish_reason == "stop"
    assert [o.token_id for o in outs["ignored"]] == expected and outs["ignored"][-1].finish_reason == "length"
    assert [o.token_id for o in outs["stop_id"]] == expected[: expected.index(expected[1]) + 1]
    assert outs["stop_id"][-1].finish_reason == "stop"


def test_abort_frees_blocks_at_once(model):
    scheduler, _ = make(model, max_num_batched_tokens=16, max_num_seqs=16)
    for i, ids in enumerate(prompts(4, seed=3, low=30, high=40)):
        scheduler.add(EngineRequest(f"r{i}", ids, replace(GREEDY, max_tokens=50)))
    for _ in range(4):
        scheduler.step()
    assert scheduler.running and scheduler.waiting and scheduler.blocks_in_use > 0
    for i in range(4):
        assert scheduler.abort(f"r{i}")
    assert scheduler.blocks_in_use == 0 and scheduler.allocator.num_free == scheduler.allocator.num_blocks
    assert not scheduler.has_work() and scheduler.step() == []
    assert not scheduler.abort("r0")


def test_logprobs_and_seeded_sampling_match_offline(model):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=11, logprobs=3, max_tokens=5,
                            ignore_eos=True)
    scheduler, _ = make(model)
    outs = run_all(scheduler, [EngineRequest("s", [3, 1, 4, 1, 5], params)])["s"]
    reference = generate(ReferenceEngine(model, max_tokens=256), [Request([3, 1, 4, 1, 5], params)], frozenset())[0]
    assert [o.token_id for o in outs] == reference.token_ids
    for out, expected in zip(outs, reference.logprobs):
        assert out.logprobs.keys() == expected.keys()
        assert np.allclose(list(out.logprobs.values()), list(expected.values()))


def test_offline_generation_stops_by_the_scheduler_rules(model):
    """generate() is the scheduler stepped to the end: an end-of-sequence token stops a request that does not
    ignore it, max_model_len caps one that does, and every KV block is free after."""
    alone = offline(model, [[1, 2, 3]], GREEDY)[0]
    eos = alone[2]
    engine = ReferenceEngine(model, max_tokens=256)
    stopped, capped = generate(engine, [Request([1, 2, 3], replace(GREEDY, ignore_eos=False)),
                                        Request([1, 2, 3], GREEDY)], {eos}, max_model_len=7)
    assert stopped.token_ids == alone[: alone.index(eos) + 1] and stopped.finish_reason == "stop"
    assert capped.token_ids == alone[:4] and capped.finish_reason == "length"
    assert engine.allocator.num_free == engine.allocator.num_blocks


# --- the engine loop ---------------------------------------------------------------------------------------------

def collect(loop: EngineLoop, request: EngineRequest, timeout: float = 30.0, sink_event=None) -> list:
    got, done = [], threading.Event()

    def sink(item):
        if sink_event is not None:
            sink_event()
        got.append(item)
        if isinstance(item, Exception) or item.finish_reason:
            done.set()
    loop.submit(request, sink)
    assert done.wait(timeout), got
    return got


def test_engine_loop_serves_requests_and_refuses_what_never_fits(model):
    scheduler, _ = make(model, kv_tokens=64)
    loop = EngineLoop(scheduler).start()
    try:
        got = collect(loop, EngineRequest("a", [1, 2, 3], GREEDY))
        assert [o.token_id for o in got] == offline(model, [[1, 2, 3]], GREEDY)[0]
        (error,) = collect(loop, EngineRequest("b", list(range(1, 80)), GREEDY))
        assert isinstance(error, RequestError) and "never fit" in str(error)
        assert loop.healthy
    finally:
        loop.stop()


class OrderedEngine:
    """Records when each step is launched and done, around the reference engine."""

    def __init__(self, engine, events: list[str]) -> None:
        self.allocator, self._engine, self.events = engine.allocator, engine, events

    def sample(self, chunks, params, token_index, constraints=None, launched=None):
        def on_launch() -> None:
            self.events.append("launched")
            if launched is not None:
                launched()
        result = self._engine.sample(chunks, params, token_index, constraints, on_launch)
        self.events.append("done")
        return result

    def release(self, seq) -> None:
        self._engine.release(seq)


def test_engine_loop_hands_a_steps_tokens_over_once_the_next_step_is_launched(model):
    """Streaming step N's tokens overlaps step N+1 on the device; the last step's go out as the loop goes idle."""
    events: list[str] = []
    loop = EngineLoop(Scheduler(OrderedEngine(ReferenceEngine(model, max_tokens=256), events), frozenset())).start()
    try:
        got = collect(loop, EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)),
                      sink_event=lambda: events.append("token"))
    finally:
        loop.stop()
    assert len(got) == 3
    assert events == ["launched", "done", "launched", "token", "done", "launched", "token", "done", "token"]


class BrokenEngine:
    """An engine whose steps raise, as a GPU engine does after a CUDA error."""

    def __init__(self, engine) -> None:
        self.allocator, self._engine = engine.allocator, engine

    def sample(self, chunks, params, token_index, constraints=None, launched=None):
        raise RuntimeError("illegal memory access")

    def release(self, seq) -> None:
        self._engine.release(seq)


def test_engine_loop_failure_reaches_every_request_and_refuses_new_ones(model):
    loop = EngineLoop(Scheduler(BrokenEngine(ReferenceEngine(model, max_tokens=256)), frozenset())).start()
    (error,) = collect(loop, EngineRequest("a", [1, 2, 3], GREEDY))
    assert isinstance(error, EngineDead) and "illegal memory access" in str(error)
    assert not loop.healthy
    with pytest.raises(EngineDead, match="RuntimeError: illegal memory access"):
        loop.submit(EngineRequest("b", [1], GREEDY), lambda item: None)
    loop.stop()


def test_engine_loop_traces_each_step_with_what_it_ran(model):
    """The serving trace: one JSON line per step whose token counts add up to the prompt and the decodes."""
    import io
    import json

    scheduler, _ = make(model, max_num_batched_tokens=16, max_num_seqs=4)
    trace = io.StringIO()
    loop = EngineLoop(scheduler, trace=trace).start()
    try:
        got = collect(loop, EngineRequest("a", list(range(1, 31)), GREEDY))
    finally:
        loop.stop()
    lines = [json.loads(line) for line in trace.getvalue().splitlines()]
    assert len(got) == GREEDY.max_tokens
    assert [line["prefill_tokens"] for line in lines] == [16, 14] + [0] * (GREEDY.max_tokens - 1)
    assert [line["tokens"] for line in lines] == [16, 14] + [1] * (GREEDY.max_tokens - 1)
    assert [line["outputs"] for line in lines] == [0] + [1] * GREEDY.max_tokens
    assert all(line["seconds"] > 0 and line["schedule"] >= 0 and line["after"] >= 0 for line in lines)
    assert lines[0]["gap"] is None and all(line["gap"] >= 0 for line in lines[1:])


def test_the_trace_counts_the_tokens_of_steps_that_only_scored_a_prompt(model):
    """A request wanting prompt logprobs has its prompt scored apart, its first token drawn there: that step's line
    counts it, so the lines' outputs add up to every token the request got."""
    import io
    import json

    scheduler, _ = make(model, max_num_batched_tokens=16, max_num_seqs=4)
    trace = io.StringIO()
    loop = EngineLoop(scheduler, trace=trace).start()
    try:
        got = collect(loop, EngineRequest("a", list(range(1, 31)), replace(GREEDY, prompt_logprobs=1)))
    finally:
        loop.stop()
    lines = [json.loads(line) for line in trace.getvalue().splitlines()]
    assert sum(line["outputs"] for line in lines) == len(got) == GREEDY.max_tokens
    scoring = [line for line in lines if line["prefill_tokens"]]  # chunks of at most max_num_seqs tokens
    assert sum(line["tokens"] for line in scoring) == 30 and [line["outputs"] for line in scoring][-1] == 1


class FakeLoop:
    """Records call_soon_threadsafe calls; `closed` makes them raise as a closed event loop's do."""

    def __init__(self, closed: bool = False) -> None:
        self.calls, self.closed = [], closed

    def call_soon_threadsafe(self, callback, *args):
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append((callback, args))


def test_a_steps_items_reach_an_event_loop_in_one_hand_over():
    from pegainfer.runtime.engine_loop import LoopSink, hand_over

    loop, got, plain = FakeLoop(), [], []
    first, second = LoopSink(loop, lambda item: got.append(("a", item))), LoopSink(loop, lambda i: got.append(("b", i)))
    hand_over([(first, 1), (plain.append, 2), (second, 3), (first, 4)])
    assert plain == [2] and got == [] and len(loop.calls) == 1
    callback, args = loop.calls[0]
    callback(*args)  # what the event loop runs
    assert got == [("a", 1), ("b", 3), ("a", 4)]
    hand_over([(LoopSink(FakeLoop(closed=True), got.append), 5)])  # a server shutting down: dropped, no error
    assert got[-1] == ("a", 4)


def test_the_scheduler_benchmark_drives_the_scheduler_as_the_engines_are_driven():
    """scripts/bench_scheduler.py's stand-in engine takes the engine's sample() as the scheduler calls it: every
    request runs to its length: 8 requests of 20 + 4 tokens at 4 running take two rounds of a prefill step (its
    first token) and 3 decode steps."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_scheduler.py"
    run = subprocess.run([sys.executable, str(script), "--requests", "8", "--max-num-seqs", "4", "--prompt", "20",
                          "--output", "4"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    found = re.fullmatch(r"(\d+) steps: [\d.]+ ms a step, of which pack_step [\d.]+ ms\n", run.stdout)
    assert found and int(found.group(1)) == 8, run.stdout
