"""The serving sweep's load (`pegainfer bench serve`'s own client: random prompts of exactly --input-len tokens,
--output-len out, greedy, ignore_eos, streamed) with a JSON schema on every request (`response_format`
json_schema) against the same load without one, alternating rounds with fresh prompts (a seed each), so that
the throughput cost of the grammar is read on one server in one run. The checkpoint needs a tokenizer with
punctuation (scripts/gpu/random_checkpoint.py --tokenizer bpe): its random tokens mostly decode to no text, so
without a grammar TTFT and TPOT count from the first token with text; output tok/s (the server's usage) and the
step trace (--trace, the server's --trace-steps file, cut per round) are the measures to compare.

    python3 scripts/gpu/structured_sweep.py --model NAME --tokenizer CKPT --concurrency 32 --out DIR [--trace FILE]
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import trace_summary  # noqa: E402  (scripts/gpu/trace_summary.py)

from pegainfer.server import bench  # noqa: E402

# A record to extract: an object of a name, an age and tags, the kind of schema structured outputs serve most.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
plain_body = bench.request_body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each arm, alternating (default 2)")
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for round_ in range(args.rounds):
        for arm in ("none", "json_schema"):
            seed = 1000 + 10 * round_ + (arm != "none")
            extra = {"response_format": RESPONSE_FORMAT} if arm != "none" else {}
            bench.request_body = lambda config, prompt, extra=extra: {**plain_body(config, prompt), **extra}
            config = bench.BenchConfig(base_url=args.base_url, model=args.model, input_len=args.input_len,
                                       output_len=args.output_len, num_prompts=max(2 * args.concurrency, 16),
                                       max_concurrency=args.concurrency, seed=seed, tokenizer=args.tokenizer)
            first = len(args.trace.read_text().splitlines()) if args.trace and args.trace.is_file() else 0
            report = asyncio.run(bench.run_bench(config))
            steps = None
            if args.trace and args.trace.is_file():
                lines = [json.loads(line) for line in args.trace.read_text().splitlines()[first:] if line.strip()]
                steps = trace_summary.summarise(lines)
            rows.append({"arm": arm, "round": round_, "seed": seed, "report": report, "steps": steps})
            (args.out / "structured_sweep.json").write_text(json.dumps(rows, indent=1))
    sample = asyncio.run(one_sample(args))
    (args.out / "structured_sample.json").write_text(json.dumps(sample, indent=1))
    print(f"json_schema sample (greedy, {args.output_len} tokens at most, no ignore_eos): {sample}")
    print(f"{'arm':>12} {'round':>5} {'done':>7} {'out_tok/s':>9} {'ttft_ms':>8} {'tpot_ms':>8} {'dec_ms':>7} "
          f"{'dec_n':>6} {'mix_ms':>7} {'mix_n':>6}")
    for r in rows:
        rep, st = r["report"], r["steps"] or {}
        print(f"{r['arm']:>12} {r['round']:>5} {rep['completed']:>3}/{rep['num_prompts']:<3} "
              f"{rep['output_throughput']:9.0f} {rep.get('mean_ttft_ms') or 0:8.0f} {rep.get('mean_tpot_ms') or 0:8.2f} "
              f"{st.get('decode_ms', 0):7.2f} {st.get('decode_steps', 0):6d} {st.get('mixed_ms', 0):7.1f} "
              f"{st.get('mixed_steps', 0):6d}")
        if rep.get("errors"):
            print("   errors:", rep["errors"][:3])


async def one_sample(args) -> dict:
    """One constrained completion with its text, and whether it parses against the schema's keys."""
    import httpx

    body = {"model": args.model, "prompt": "Extract the record:", "max_tokens": args.output_len,
            "temperature": 0.0, "response_format": RESPONSE_FORMAT}
    async with httpx.AsyncClient(timeout=120) as client:
        reply = (await client.post(args.base_url + "/v1/completions", json=body)).json()
    text = reply["choices"][0]["text"]
    try:
        value = json.loads(text, strict=False)
        parsed = sorted(value) == ["age", "name", "tags"]
    except json.JSONDecodeError:
        parsed = False
    return {"text": text[:200], "finish_reason": reply["choices"][0]["finish_reason"], "parses": parsed}


if __name__ == "__main__":
    main()
