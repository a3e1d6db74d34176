"""`pegainfer bench serve`: its flags and its run, the load generator of server/bench.py against any
OpenAI-compatible server."""

import argparse
import json
import os
import sys
from pathlib import Path

from pegainfer import argtypes
from pegainfer.errors import PegainferError


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of `pegainfer bench serve`, added to the bench subcommand (they are ignored by decode and prefill)."""
    group = p.add_argument_group("bench serve (an OpenAI-API load generator against any compatible server)")
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    group.add_argument("--model", dest="served_model", help="the model name to send (default: the MODEL argument)")
    group.add_argument("--dataset", choices=["random"], default="random", help="random token prompts")
    group.add_argument("--input-len", type=argtypes.positive_int, default=1024, help="prompt tokens (default 1024)")
    group.add_argument("--output-len", type=argtypes.positive_int, default=128,
                       help="tokens per completion (default 128)")
    group.add_argument("--num-prompts", type=argtypes.positive_int, default=100, help="requests to send (default 100)")
    group.add_argument("--request-rate", type=float, default=float("inf"),
                       help="mean requests per second, Poisson arrivals (default inf: all at once)")
    group.add_argument("--max-concurrency", type=argtypes.positive_int, default=None, help="requests in flight at most")
    group.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrival times (default 0)")
    group.add_argument("--endpoint", choices=["/v1/completions", "/v1/chat/completions"], default="/v1/completions",
                       help="the route to load (default /v1/completions)")
    group.add_argument("--tokenizer", type=Path, default=None,
                       help="checkpoint folder whose tokenizer.json turns the random prompts into text (default: "
                            "send token ids, which /v1/completions of pegainfer and vLLM take)")
    group.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                       help="do not send ignore_eos (for servers that refuse fields OpenAI does not define); the "
                            "report counts the output tokens the server says it made")
    group.add_argument("--api-key", dest="bench_api_key", default=os.environ.get("OPENAI_API_KEY"),
                       help="bearer key for the server (default $OPENAI_API_KEY)")


def run_bench_serve(args: argparse.Namespace) -> int:
    """The load, its report printed (or written with --result-file); 1 when any request failed."""
    import asyncio

    from pegainfer.server.bench import BenchConfig, format_report, run_bench

    model = args.served_model or args.model
    if model is None:
        raise PegainferError("bench serve needs the served model's name: pegainfer bench serve --model NAME")
    config = BenchConfig(base_url=args.base_url.rstrip("/"), model=model, endpoint=args.endpoint,
                         input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                         request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
                         tokenizer=args.tokenizer, api_key=args.bench_api_key, ignore_eos=args.ignore_eos)
    report = asyncio.run(run_bench(config))
    if args.result_file:
        from pegainfer.runtime.snapshot import write_snapshot

        write_snapshot(args.result_file, report, None, args.argv)  # the card is the server's, unknown to its client
    print(json.dumps(report, indent=1) if args.json else format_report(report), end="\n" if args.json else "")
    if report["completed"] < report["num_prompts"]:
        print(f"pegainfer: {report['num_prompts'] - report['completed']} requests failed; first error: "
              f"{report['errors'][0]}", file=sys.stderr)
        return 1
    return 0
