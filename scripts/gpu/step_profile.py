"""On the GPU: where a decode step's time goes, kernel by kernel, as the CUDA graph replays it (programmatic launch
and all), from CUPTI's kernel records through torch.profiler. `pegainfer bench decode --breakdown` times each launch
of an eager step between CUDA events, whose gaps and lost overlap the graph does not have.

Each kernel is charged the time from the previous kernel's end to its own end: the time by which it moved the
step's end, so that the charges add up to the step's span on the GPU (an overlapping kernel, one waiting on its
predecessor under programmatic launch, is charged only what it ran past that predecessor's end). Kernels are told
apart by name and grid (QKV's and gate/up's normed tiles share a name).

    PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3 python3 scripts/gpu/step_profile.py qwen3-4b --batch 1 --out $OUT/prof
"""

import argparse
import json
from pathlib import Path

import torch

from pegainfer.errors import PegainferError
from pegainfer.runtime import bench
from pegainfer.runtime.batch import Chunk
from pegainfer.runtime.device import visible_sm
from pegainfer.runtime.gpu.start import ensure_manifest


def kernel_records(trace: Path) -> list[dict]:
    """The trace's kernel records, in start order: name, grid, start and end in microseconds."""
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return sorted(({"name": e["name"], "grid": tuple(e.get("args", {}).get("grid", ())), "start": float(e["ts"]),
                    "end": float(e["ts"]) + float(e["dur"])} for e in kernels), key=lambda k: k["start"])


def split_steps(kernels: list[dict], per_step: int) -> list[list[dict]]:
    """The records cut into steps of `per_step` kernels (every replay of the graph launches the same ones)."""
    whole = len(kernels) // per_step
    return [kernels[i * per_step:(i + 1) * per_step] for i in range(whole)]


def charge(step: list[dict]) -> tuple[list[float], list[float]]:
    """Each kernel's charge (its end less the previous kernel's end) and the idle gap before it (its start past the
    previous kernel's end, when it did not overlap it)."""
    charges, gaps = [step[0]["end"] - step[0]["start"]], [0.0]
    for before, kernel in zip(step, step[1:]):
        charges.append(kernel["end"] - before["end"])
        gaps.append(max(0.0, kernel["start"] - before["end"]))
    return charges, gaps


def summarise(steps: list[list[dict]]) -> dict:
    """Per kernel kind (name, grid): launches a step, charge and duration a step (medians over the steps), the
    step's span and its idle gaps (within a step: the wait between steps is the host's)."""
    kinds: dict[tuple, dict] = {}
    spans, idle = [], []
    for step in steps:
        charges, gaps = charge(step)
        spans.append(step[-1]["end"] - step[0]["start"])
        idle.append(sum(gaps))
        totals: dict[tuple, list[float]] = {}
        for kernel, paid in zip(step, charges):
            entry = totals.setdefault((kernel["name"], kernel["grid"]), [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += paid
            entry[2] += kernel["end"] - kernel["start"]
        for key, (count, paid, ran) in totals.items():
            kind = kinds.setdefault(key, {"count": count, "charged": [], "ran": []})
            kind["charged"].append(paid)
            kind["ran"].append(ran)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    rows = [{"name": name, "grid": list(grid), "launches": kind["count"], "charged_us": median(kind["charged"]),
             "ran_us": median(kind["ran"])} for (name, grid), kind in kinds.items()]
    rows.sort(key=lambda r: -r["charged_us"])
    return {"steps": len(steps), "span_us": median(spans), "idle_us": median(idle), "kernels": rows}


def profile(engine, batch: int, context: int, steps: int, trace: Path) -> dict:
    """`steps` decode steps of `batch` sequences at `context` cached tokens, traced after the graph's capture. Each
    step is waited for, as `pegainfer bench` and serving wait: the next step's upload reuses the pinned staging
    buffer that the last step's copy reads."""
    seqs = bench._sequences(engine, batch, context, steps + bench.WARMUP)
    for _ in range(bench.WARMUP):  # the graph's capture and first replays stay outside the trace
        engine.run([Chunk(s, 1) for s in seqs])
        engine.ctx.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.run([Chunk(s, 1) for s in seqs])
            engine.ctx.synchronize()
    for seq in seqs:
        engine.release(seq)
    prof.export_chrome_trace(str(trace))
    kernels = kernel_records(trace)
    if not kernels or len(kernels) % steps:
        raise SystemExit(f"{len(kernels)} kernel records for {steps} steps: not whole steps (records dropped?)")
    return summarise(split_steps(kernels, len(kernels) // steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cache-dir")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for name in ("batch", "context", "steps"):
        values = getattr(args, name) if name == "batch" else [getattr(args, name)]
        if min(values) < 1:
            parser.error(f"--{name}: at least 1, got {min(values)}")
    sm = visible_sm()
    if sm is None:
        parser.error("needs a visible GPU (and cuda-bindings)")
    loaded = bench.bench_model(args.model, args.quantization, args.kv_cache_dtype)
    try:  # compiled first where it is missing, as `pegainfer bench` does
        manifest = ensure_manifest(loaded.spec, sm, args.cache_dir, label=args.model)
    except PegainferError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    engine = bench.engine_for(loaded, manifest, max_tokens=max(args.batch), max_batch=max(args.batch),
                              max_model_len=args.context + args.steps + bench.WARMUP + 16)
    for batch in args.batch:
        summary = profile(engine, batch, args.context, args.steps, args.out / f"trace_batch{batch}.json")
        (args.out / f"batch{batch}.json").write_text(json.dumps(summary, indent=1))
        print(f"batch {batch}, context {args.context}: span {summary['span_us']:.0f} us a step, idle gaps "
              f"{summary['idle_us']:.0f} us ({summary['steps']} steps, medians)")
        print(f"{'charged us':>10} {'ran us':>8} {'n':>3}  kernel (grid)")
        for r in summary["kernels"]:
            print(f"{r['charged_us']:>10.1f} {r['ran_us']:>8.1f} {r['launches']:>3}  {r['name'][:60]} {r['grid']}")


if __name__ == "__main__":
    main()
