"""On the GPU: async scheduling (runtime/overlap.py) against plain steps, in-process, on one GpuEngine of a random
full-size model. The same requests through the scheduler both ways: the tokens must be equal (greedy, seeded and
top-k sampling, every request admitted at once); with stops on tokens learnt a step late and more requests than
max_num_seqs (admitted while a step is in flight) every request must end where its stop or length says; requests
under penalties and under a grammar (a bitmask walk of this script), read between the next step's layers and its
sampler tail, must give equal tokens too. Then the wall time of each way over the serving sweep's shape (64
requests of 1024 + 128 tokens at once, greedy; and again with penalties on every request), median of a few rounds,
printed as a table.

    PEGAINFER_CACHE=$PWD/.gpu/cache_async python3 scripts/gpu/async_check.py qwen3-4b --out $OUT/async
"""

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from pegainfer.ir.ops.penalties import Penalties
from pegainfer.runtime import bench
from pegainfer.runtime.constraint import PenaltyState, pack_mask
from pegainfer.runtime.device import visible_sm
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig


def mixed_requests(vocab: int, count: int) -> list[EngineRequest]:
    rng = np.random.default_rng(1)
    kinds = [SamplingParams(max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=3, max_tokens=33, ignore_eos=True),
             SamplingParams(temperature=0.8, top_k=20, seed=4, max_tokens=25, logprobs=3, ignore_eos=True)]
    return [EngineRequest(f"r{i}", rng.integers(0, vocab, int(rng.integers(5, 600))).tolist(), kinds[i % 3])
            for i in range(count)]


PENALTIES = Penalties(presence=0.5, frequency=0.3, repetition=1.2)


class Walk:
    """A grammar: from token t the next is one of 8 ids spread from t over the vocabulary, drawn in the sampler tail
    under its bitmask; `refused` counts tokens it was told but did not allow."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.last, self.refused = vocab, 1, 0

    def _ids(self) -> list[int]:
        return [(self.last * 7919 + 4099 * k + 1) % self.vocab for k in range(8)]

    def allowed(self, vocab_size: int) -> np.ndarray:
        mask = np.zeros(vocab_size, dtype=bool)
        mask[self._ids()] = True
        return mask

    def bitmask(self, vocab_size: int) -> np.ndarray:
        return pack_mask(self.allowed(vocab_size))

    def accept(self, token: int) -> None:
        self.refused += token not in self._ids()
        self.last = token


def constrained(requests: list[EngineRequest], vocab: int) -> list[EngineRequest]:
    """Every other request under penalties, the rest under a fresh Walk (a run tells its grammars tokens)."""
    return [replace(r, constraint=PenaltyState(PENALTIES, r.prompt_ids, vocab, []) if i % 2 else Walk(vocab),
                    params=replace(r.params, logprobs=None) if i % 2 else r.params)  # penalties: no top logprobs
            for i, r in enumerate(requests)]


def run(engine, requests: list[EngineRequest], overlap: bool, eos: frozenset[int], max_seqs: int
        ) -> tuple[dict[str, list[tuple[int, str | None]]], float, int]:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048, max_model_len=2048,
                             prefix_cache=False, async_scheduling=overlap)  # each run's own cache would keep blocks
    scheduler = Scheduler(engine, eos, config)
    for request in requests:
        scheduler.add(request)
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    began, steps = time.perf_counter(), 0
    while scheduler.has_work():
        steps += 1
        for out in scheduler.step():
            outputs[out.request_id].append((out.token_id, out.finish_reason))
    engine.ctx.synchronize()
    assert scheduler.blocks_in_use == 0 and (scheduler.overlap is not None) == overlap
    return outputs, time.perf_counter() - began, steps


def check_tokens(engine, vocab: int, report: dict) -> None:
    """Every request admitted at once and none stopping early, so both ways run steps of the same rows (the kernels
    a step's row count picks round alike): the tokens must be equal. Then with stops on tokens drawn mid-way, where
    a stop learnt a step late adds a wasted row to a step (another row count, which may flip a near tie): each
    request must still end on its stop token or its length."""
    requests = mixed_requests(vocab, 40)
    plain, _, _ = run(engine, requests, False, frozenset(), 64)
    ahead, _, _ = run(engine, requests, True, frozenset(), 64)
    report["tokens_equal"] = ahead == plain
    report["requests_differing"] = [k for k, v in ahead.items() if v != plain[k]]
    eos = frozenset({plain["r0"][10][0], plain["r4"][20][0]})
    stopping = [replace(r, params=replace(r.params, ignore_eos=False)) for r in requests]
    ahead, _, _ = run(engine, stopping, True, eos, 16)
    ends = [v[-1][1] == ("stop" if v[-1][0] in eos else "length") and all(t not in eos for t, _ in v[:-1])
            for v in ahead.values()]
    report["stops_where_due"] = all(ends)
    report["stopped_early"] = sum(v[-1][1] == "stop" for v in ahead.values())
    requests = requests[:24]
    plain, _, _ = run(engine, constrained(requests, vocab), False, frozenset(), 64)
    walks = constrained(requests, vocab)
    ahead, _, _ = run(engine, walks, True, frozenset(), 64)
    report["constrained_tokens_equal"] = ahead == plain
    report["constrained_differing"] = [k for k, v in ahead.items() if v != plain[k]]
    report["walk_refusals"] = sum(r.constraint.refused for r in walks if isinstance(r.constraint, Walk))


def time_sweep_shape(engine, vocab: int, report: dict, rounds: int) -> None:
    """Plain and async, without and with penalties on every request (drawn in the tail, read inside the launch)."""
    rng = np.random.default_rng(2)
    greedy = SamplingParams(max_tokens=128, ignore_eos=True)
    times: dict[tuple[bool, bool], list[float]] = {(p, o): [] for p in (False, True) for o in (False, True)}
    for r in range(rounds):
        requests = [EngineRequest(f"t{r}-{i}", rng.integers(0, vocab, 1024).tolist(), greedy) for i in range(64)]
        for (penalized, overlap), seconds in times.items():
            batch = [replace(q, constraint=PenaltyState(PENALTIES, q.prompt_ids, vocab, [])) for q in requests] \
                if penalized else requests
            seconds.append(run(engine, batch, overlap, frozenset(), 64)[1])
    for penalized in (False, True):
        key = "penalties" if penalized else "none"
        report.setdefault("sweep_shape_s", {})[key] = {"plain": times[penalized, False],
                                                       "async": times[penalized, True]}
        report.setdefault("output_tok_s", {})[key] = {way: 64 * 128 / np.median(times[penalized, overlap])
                                                      for way, overlap in (("plain", False), ("async", True))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if visible_sm() is None:
        parser.error("needs a visible GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    engine = bench.random_engine(args.model, max_tokens=2048, max_batch=64, max_model_len=2048)
    vocab = engine.vocab_size
    report: dict = {}
    check_tokens(engine, vocab, report)
    time_sweep_shape(engine, vocab, report, args.rounds)
    (args.out / "async_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "sweep_shape_s"}))
    print(f"{'64 x (1024 + 128), greedy':<32} {'plain':>9} {'async':>9}")
    for key, label in (("none", ""), ("penalties", ", penalties")):
        plain, ahead = (np.median(report["sweep_shape_s"][key][way]) for way in ("plain", "async"))
        print(f"{'wall s (median)' + label:<32} {plain:9.3f} {ahead:9.3f}")
        print(f"{'output tok/s' + label:<32} {64 * 128 / plain:9.0f} {64 * 128 / ahead:9.0f}")


if __name__ == "__main__":
    main()
