"""Summarises a `pegainfer serve --trace-steps` file: where a serving run's time went. Decode-only steps (every
sequence one token: CUDA-graph replays on the GPU) and steps holding prompt chunks (eager) are reported apart,
beside the serving loop's own time between and around steps. With async scheduling a step's seconds span the loop's
call that read it (the next step's scheduling and launch, then the wait): decode ms is then the wall per step; a
call that only launched (nothing was in flight) writes no line, and its time falls in the next line's gap.

    python scripts/gpu/trace_summary.py TRACE.jsonl [--label c32]"""

import argparse
import json
from pathlib import Path


def summarise(lines: list[dict]) -> dict:
    decode = [s for s in lines if s["prefill_tokens"] == 0]
    mixed = [s for s in lines if s["prefill_tokens"] > 0]
    wall = lines[-1]["start"] + lines[-1]["seconds"] - lines[0]["start"] if lines else 0.0
    engine = sum(s["seconds"] for s in lines)
    loop = sum(s["schedule"] + s["after"] for s in lines)
    gaps = sum(s["gap"] or 0.0 for s in lines[1:])
    return {
        "steps": len(lines), "wall_s": wall, "engine_s": engine, "loop_s": loop, "gap_s": gaps,
        "decode_steps": len(decode),
        "decode_ms": 1e3 * sum(s["seconds"] for s in decode) / max(len(decode), 1),
        "decode_seqs": sum(s["seqs"] for s in decode) / max(len(decode), 1),
        "mixed_steps": len(mixed),
        "mixed_ms": 1e3 * sum(s["seconds"] for s in mixed) / max(len(mixed), 1),
        "mixed_tokens": sum(s["tokens"] for s in mixed) / max(len(mixed), 1),
        "slowest_ms": 1e3 * max((s["seconds"] for s in lines), default=0.0),
    }


def format_row(label: str, r: dict) -> str:
    return (f"{label:>6} {r['steps']:6d} {r['wall_s']:7.2f} {r['engine_s']:7.2f} {r['loop_s']:6.2f} {r['gap_s']:6.2f} "
            f"{r['decode_steps']:6d} {r['decode_ms']:7.2f} {r['decode_seqs']:6.1f} {r['mixed_steps']:6d} "
            f"{r['mixed_ms']:7.1f} {r['mixed_tokens']:7.0f} {r['slowest_ms']:8.1f}")


HEADER = (f"{'label':>6} {'steps':>6} {'wall_s':>7} {'engine':>7} {'loop':>6} {'gaps':>6} {'dec_n':>6} "
          f"{'dec_ms':>7} {'seqs':>6} {'mix_n':>6} {'mix_ms':>7} {'mix_tok':>7} {'slow_ms':>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--label", default="all")
    parser.add_argument("--header", action="store_true")
    args = parser.parse_args()
    lines = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    if args.header:
        print(HEADER)
    print(format_row(args.label, summarise(lines)))


if __name__ == "__main__":
    main()
