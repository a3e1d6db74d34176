"""On the GPU: what the serving loop's steps cost, in-process, without the server. For a prefill-only, a mixed and
a decode step of the serving sweep's shapes: the host's time to issue the step (packing, upload, launches) and
the whole step through `engine.sample` as the scheduler calls it; each alone, beside a busy Python thread (as the
server's event loop is under load: the engine thread then waits for the GIL after every driver call that drops
it), and beside it with the GIL's switch interval lowered. Then the mixed step's kernels by CUPTI's records.

    PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3 python3 scripts/gpu/step_costs.py qwen3-4b --out $OUT/costs
"""

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pegainfer.runtime import bench
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.device import visible_sm
from pegainfer.runtime.gpu.engine import GpuEngine
from pegainfer.runtime.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)


def fresh(engine: GpuEngine, lengths: list[int], first_id: int) -> list[Sequence]:
    rng = np.random.default_rng(first_id)
    vocab = engine.model.spec.config.vocab_size
    return [Sequence(first_id + i, [int(t) for t in rng.integers(0, vocab, n + 1)]) for i, n in enumerate(lengths)]


def shapes(engine: GpuEngine, decode_seqs: list[Sequence]) -> dict[str, Callable[[], tuple[list[Chunk], list]]]:
    """Each case builds its chunks afresh (new prompts each time) and returns them with what to release."""
    def prefill(lengths: list[int]) -> Callable:
        def make() -> tuple[list[Chunk], list]:
            seqs = fresh(engine, lengths, 10_000)
            return [Chunk(s, n) for s, n in zip(seqs, lengths)], seqs
        return make

    def mixed() -> tuple[list[Chunk], list]:
        seqs = fresh(engine, [1024, 962], 20_000)
        return [*(Chunk(s, 1) for s in decode_seqs[:62]), Chunk(seqs[0], 1024), Chunk(seqs[1], 962)], seqs

    def decode() -> tuple[list[Chunk], list]:
        return [Chunk(s, 1) for s in decode_seqs], []
    return {"prefill 1024": prefill([1024]), "prefill 2x1024": prefill([1024, 1024]), "mixed 62+1986": mixed,
            "decode 64 @1k": decode}


def time_case(engine: GpuEngine, make: Callable, reps: int) -> tuple[float, float]:
    """Medians in ms: the host's issue time (sample() up to its first synchronisation is not separable, so the
    issue is timed through run()) and the whole sample() call."""
    issue, whole = [], []
    for _ in range(reps + 1):
        chunks, seqs = make()
        began = time.perf_counter()
        engine.run(chunks)
        issued = time.perf_counter()
        engine.ctx.synchronize()
        issue.append((issued - began) * 1e3)
        for s in seqs:
            engine.release(s)
        rewind(chunks, seqs)
        chunks, seqs = make()
        began = time.perf_counter()
        engine.sample(chunks, [GREEDY] * len(chunks), [1] * len(chunks))
        whole.append((time.perf_counter() - began) * 1e3)
        for s in seqs:
            engine.release(s)
        rewind(chunks, seqs)
    return float(np.median(issue[1:])), float(np.median(whole[1:]))


def rewind(chunks: list[Chunk], fresh_seqs: list[Sequence]) -> None:
    """Decode sequences go back the token the step cached, so every repetition has the same shape."""
    released = {id(s) for s in fresh_seqs}
    for c in chunks:
        if id(c.seq) not in released:
            c.seq.num_cached -= c.num_tokens


def busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2000))


def kernels_of(engine: GpuEngine, make: Callable, out: Path) -> list[tuple[str, int, float]]:
    import torch
    chunks, seqs = make()
    engine.run(chunks)
    engine.ctx.synchronize()
    for s in seqs:
        engine.release(s)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            chunks, seqs = make()
            engine.run(chunks)
            engine.ctx.synchronize()
            for s in seqs:
                engine.release(s)
    trace = out / "mixed_trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    trace.unlink()
    by: dict[str, list] = {}
    for e in events:
        entry = by.setdefault(e["name"][:70], [0, 0.0])
        entry[0] += 1
        entry[1] += float(e["dur"])
    starts = sorted(float(e["ts"]) for e in events)
    ends = sorted(float(e["ts"]) + float(e["dur"]) for e in events)
    print(f"mixed step on the GPU: {len(events) // 3} kernels, span of 3 steps {(ends[-1] - starts[0]) / 3e3:.2f} ms "
          f"each, busy {sum(v[1] for v in by.values()) / 3e3:.2f} ms each")
    return sorted(((n, c // 3, us / 3) for n, (c, us) in by.items()), key=lambda r: -r[2])


def host_profile(engine: GpuEngine, make: Callable, out: Path) -> str:
    """cProfile of the host's issue of one eager step (packing, upload, every launch), the top entries by own time."""
    import cProfile
    import io
    import pstats
    chunks, seqs = make()
    profiler = cProfile.Profile()
    profiler.enable()
    engine.run(chunks)
    profiler.disable()
    engine.ctx.synchronize()
    for s in seqs:
        engine.release(s)
    rewind(chunks, seqs)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    (out / "host_profile.txt").write_text(text.getvalue())
    return text.getvalue()


def consistency(engine: GpuEngine, decode_seqs: list[Sequence]) -> str:
    """The mixed step's logits against the same rows run apart (a decode-only step, then the chunks alone): the
    mixed variant's attention must give what the decode and the prefill variants give, up to bf16 rounding."""
    mixed, seqs = shapes(engine, decode_seqs)["mixed 62+1986"]()
    together = engine.step(mixed)
    for s in seqs:
        engine.release(s)
    rewind(mixed, seqs)
    decode, chunks = mixed[:62], mixed[62:]
    apart = np.concatenate([engine.step(decode), engine.step([Chunk(c.seq, c.num_tokens) for c in chunks])])
    for s in seqs:
        engine.release(s)
    rewind(decode, [])
    gap = np.abs(together - apart).max(axis=1)
    same = (together.argmax(axis=1) == apart.argmax(axis=1)).mean()
    return (f"mixed step against its rows apart: max |logit delta| decode rows {gap[:62].max():.4f}, chunk rows "
            f"{gap[62:].max():.4f} (logits' std {apart.std():.3f}); argmax agrees on {same:.0%} of rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if visible_sm() is None:
        parser.error("needs a visible GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    engine = bench.random_engine(args.model, max_tokens=2048, max_batch=256, max_model_len=2200)
    decode_seqs = bench._sequences(engine, 64, 1024, 4 * (args.reps + 2))
    cases = shapes(engine, decode_seqs)
    rows = []
    for mode in ("alone", "busy thread", "busy, interval 0.2 ms"):
        stop = threading.Event()
        helper = None
        if mode != "alone":
            helper = threading.Thread(target=busy, args=(stop,), daemon=True)
            helper.start()
        sys.setswitchinterval(0.0002 if "interval" in mode else 0.005)
        for name, make in cases.items():
            issue, whole = time_case(engine, make, args.reps)
            rows.append({"mode": mode, "case": name, "issue_ms": issue, "step_ms": whole})
        stop.set()
        if helper is not None:
            helper.join()
    sys.setswitchinterval(0.005)
    print(consistency(engine, decode_seqs))
    profile = host_profile(engine, cases["prefill 2x1024"], args.out)
    print("\n".join(line for line in profile.splitlines() if line.strip())[:3000])
    top = kernels_of(engine, cases["mixed 62+1986"], args.out)
    (args.out / "step_costs.json").write_text(json.dumps({"rows": rows, "mixed_kernels": top}, indent=1))
    for name, count, us in top[:14]:
        print(f"{us:9.0f} us {count:4d}x  {name}")
    print(f"{'mode':<22} {'case':<16} {'issue ms':>9} {'step ms':>8}")
    for r in rows:
        print(f"{r['mode']:<22} {r['case']:<16} {r['issue_ms']:9.2f} {r['step_ms']:8.2f}")


if __name__ == "__main__":
    main()
