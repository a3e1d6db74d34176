"""Where a decode step's wall time goes beyond its kernels, per batch at context 128: `engine.run` + synchronize as
`pegainfer bench decode` times it; the host's part alone (until `run` returns); the step's captured graph replayed
alone (+ synchronize); and that replay's GPU time between CUDA events. On the GPU, after scripts/gpu/env.sh:

    PEGAINFER_CACHE=... python3 lab/step_wall.py --batch 64 256
"""

import argparse
import time

import numpy as np
from cuda.bindings import driver as cu

from pegainfer.runtime import bench
from pegainfer.runtime.batch import Chunk


def median_ms(samples: list[float]) -> float:
    return float(np.median(samples) * 1e3)


def event_ms(stream, replay) -> float:
    """The GPU time of `replay()` between two events recorded on the engine's stream."""
    _, start = cu.cuEventCreate(0)
    _, end = cu.cuEventCreate(0)
    cu.cuEventRecord(start, stream)
    replay()
    cu.cuEventRecord(end, stream)
    cu.cuEventSynchronize(end)
    _, ms = cu.cuEventElapsedTime(start, end)
    return ms / 1e3


def measure(engine, batch: int, steps: int) -> dict[str, float]:
    seqs = bench._sequences(engine, batch, 128, 3 * steps + bench.WARMUP)
    for _ in range(bench.WARMUP):
        engine.run([Chunk(s, 1) for s in seqs])
        engine.ctx.synchronize()
    wall, host = [], []
    for _ in range(steps):
        began = time.perf_counter()
        engine.run([Chunk(s, 1) for s in seqs])
        issued = time.perf_counter()
        engine.ctx.synchronize()
        wall.append(time.perf_counter() - began)
        host.append(issued - began)
    (graphs, _), = [v for k, v in engine.graphs.items() if k[0] == batch and k[1] == 1]
    replay_wall, gpu = [], []
    for _ in range(steps):
        began = time.perf_counter()
        graphs[0].replay()
        engine.ctx.synchronize()
        replay_wall.append(time.perf_counter() - began)
        gpu.append(event_ms(engine.ctx.stream, graphs[0].replay))
    for seq in seqs:
        engine.release(seq)
    return {"run_sync": median_ms(wall), "host_issue": median_ms(host), "replay_sync": median_ms(replay_wall),
            "replay_gpu": median_ms(gpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    engine = bench.random_engine("qwen3-4b", max_tokens=max(args.batch), max_batch=max(args.batch),
                                 max_model_len=128 + 4 * args.steps + 64)
    print(f"{'batch':>5} {'run+sync':>9} {'host':>7} {'replay+sync':>12} {'replay gpu':>11}  ms")
    for batch in args.batch:
        r = measure(engine, batch, args.steps)
        print(f"{batch:>5} {r['run_sync']:>9.3f} {r['host_issue']:>7.3f} {r['replay_sync']:>12.3f} "
              f"{r['replay_gpu']:>11.3f}")


if __name__ == "__main__":
    main()
