"""The serving loop's own cost per step, without a GPU: the scheduler and pack_step (the host part of every
engine step) driving an engine that returns at once. Requests as in the serving sweep: 1024-token prompts, 128
tokens out, up to 128 running (docs/BENCHMARKS.md).

    python scripts/bench_scheduler.py [--requests 256] [--max-num-seqs 128] [--prompt 1024] [--output 128] [--async]

--async: the engine offers `launch`, so the scheduler launches each step before it reads the last one
(runtime/overlap.py): the same work a step, with the bookkeeping of tokens drawn but not read yet."""

import argparse
import time
from collections.abc import Callable

import numpy as np

from pegainfer.runtime.batch import Chunk, commit_step, pack_step, release_sequence
from pegainfer.runtime.device_sampling import SampleResult
from pegainfer.runtime.kv_blocks import BlockAllocator
from pegainfer.runtime.pending_tokens import pending_rows
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig


class InstantEngine:
    """Packs each step as the GPU engine does, then draws token 7 for every row; `overlaps`: whether the scheduler
    may launch a step before it reads the last one."""

    def __init__(self, num_blocks: int, overlaps: bool) -> None:
        self.allocator = BlockAllocator(num_blocks, 16, reserved=1)
        self.pack_seconds, self.overlaps = 0.0, overlaps
        self.drawn: dict[int, int] = {}  # the last launch's draws by sequence, as the engines keep them

    def launch(self, chunks: list[Chunk], params, token_index, constraints=None,
               before_masks=None) -> Callable[[], SampleResult]:
        started = time.perf_counter()
        step = pack_step(chunks, self.allocator)
        pending_rows(chunks, step["seq_starts"], self.drawn)
        self.drawn = {c.seq.seq_id: row for row, c in enumerate(chunks)}
        self.pack_seconds += time.perf_counter() - started
        commit_step(chunks)
        result = SampleResult([7] * len(chunks), [None] * len(chunks))
        return lambda: result

    def sample(self, chunks: list[Chunk], params, token_index, constraints=None, launched=None) -> SampleResult:
        result = self.launch(chunks, params, token_index, constraints)
        if launched is not None:
            launched()
        return result()

    def release(self, seq) -> None:
        release_sequence(self.allocator, seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--async", dest="overlap", action="store_true")
    args = parser.parse_args()
    engine = InstantEngine(args.requests * -(-(args.prompt + args.output) // 16) + 1, args.overlap)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                             max_model_len=args.prompt + args.output + 1)
    scheduler = Scheduler(engine, frozenset(), config)
    rng = np.random.default_rng(0)
    for i in range(args.requests):
        scheduler.add(EngineRequest(f"r{i}", rng.integers(0, 150000, args.prompt).tolist(),
                                    SamplingParams(max_tokens=args.output, ignore_eos=True)))
    started, steps = time.perf_counter(), 0
    while scheduler.has_work():
        scheduler.step()
        steps += 1
    total = time.perf_counter() - started
    print(f"{steps} steps: {1e3 * total / steps:.2f} ms a step, of which pack_step "
          f"{1e3 * engine.pack_seconds / steps:.2f} ms")


if __name__ == "__main__":
    main()
