"""The `pegainfer` command: generate, serve, make-checkpoint, inspect, compile, bench, tune."""

import argparse
import json
import sys
import time
from pathlib import Path

from pegainfer import __version__
from pegainfer.errors import PegainferError
from pegainfer.argtypes import override, positive_float, seed, token_ids
from pegainfer.cli_kernels import CACHE_HELP, add_kernel_commands
from pegainfer.server.cli import DTYPE_CHOICES, DTYPE_HELP, add_quantization_args, add_serve
from pegainfer.server.engines import add_parallel_args, add_speculative_arg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the snapshots of `bench --result-file`
    try:
        return args.run(args)
    except PegainferError as error:
        print(f"pegainfer: error: {error}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pegainfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pegainfer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(commands)
    add_serve(commands)
    _add_make_checkpoint(commands)
    add_kernel_commands(commands)
    return parser


def _add_generate(commands) -> None:
    p = commands.add_parser("generate", help="generate tokens for one prompt")
    p.add_argument("--model-path", "--model", dest="model_path", type=Path, required=True,
                   help="Hugging Face checkpoint folder, or a Hugging Face model id such as Qwen/Qwen3-4B")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text, encoded with the checkpoint's tokenizer.json")
    prompt.add_argument("--prompt-ids", type=token_ids, help="prompt token ids, comma-separated: 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens this likely together (default 1: all)")
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token (default)")
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this fraction as likely as the top")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler, for a repeatable sample "
                   "(default: a fresh one)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K", help="report the top K logprobs per token")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present, else cpu")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    p.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP + "; for cuda, kernels missing there "
                   "are compiled at start when the compile extra is installed")
    add_quantization_args(p)
    add_parallel_args(p)
    add_speculative_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_generate)


def _add_make_checkpoint(commands) -> None:
    p = commands.add_parser("make-checkpoint", help="write a small random HF checkpoint (needs the test extra)")
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--arch", default="Qwen3ForCausalLM",
                   help="config.json architecture, any with a DAG file (default Qwen3ForCausalLM)")
    p.add_argument("--set", dest="overrides", action="append", default=[], type=override, metavar="KEY=JSON",
                   help="override a config.json key, e.g. --set num_hidden_layers=4 (repeatable)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random weights, below 2**64 (default 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the weights written (default float32)")
    p.add_argument("--logit-std", type=positive_float, default=6.0,
                   help="spread of the next-token logits (default 6)")
    p.add_argument("--tokenizer", choices=["bpe", "words"], default="bpe",
                   help="bpe: byte-level BPE trained on a little text (default); words: one word per id, so every "
                        "token a random model draws is text at once (for serving benchmarks)")
    p.add_argument("--quantization", choices=["fp8-block", "fp8-channel"], default=None,
                   help="the projections stored as float8 e4m3: fp8-block with a float32 scale per 128 x 128 block "
                        "(Qwen's own FP8 checkpoints), fp8-channel with one per output channel (llm-compressor's "
                        "FP8_DYNAMIC); default: none")
    p.set_defaults(run=run_make_checkpoint, parser=p)


def run_generate(args: argparse.Namespace) -> int:
    from pegainfer.runtime.offline import generate_one
    from pegainfer.runtime.rank_workers import Ranks
    from pegainfer.runtime.sampler import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            logprobs=args.logprobs, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                            min_p=args.min_p)
    started = time.perf_counter()
    result = generate_one(args.model_path, params, prompt=args.prompt, prompt_ids=args.prompt_ids,
                          device=args.device, dtype=args.dtype, cache_dir=args.cache_dir,
                          quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                          parallel=Ranks(args.tensor_parallel_size, args.enable_expert_parallel,
                                         args.distributed_executor_backend),
                          speculative=args.speculative_config)
    print(f"pegainfer: device {result['device']} ({result['device_reason']}); dtype {result['dtype']}",
          file=sys.stderr)
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(result["text"] if result["text"] is not None else " ".join(map(str, result["token_ids"])))
    print(f"pegainfer: {len(result['token_ids'])} tokens on {result['device']} in "
          f"{time.perf_counter() - started:.2f} s, finish_reason={result['finish_reason']}", file=sys.stderr)
    return 0


def run_make_checkpoint(args: argparse.Namespace) -> int:
    from pegainfer.fixtures.checkpoint import make_checkpoint

    out = make_checkpoint(args.out, args.arch, dict(args.overrides), seed=args.seed, dtype=args.dtype,
                          logit_std=args.logit_std, tokenizer=args.tokenizer, quantization=args.quantization)
    print(f"pegainfer: wrote a random {args.arch} checkpoint to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
