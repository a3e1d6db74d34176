"""The server's host cost per output token, without a GPU: the real app (HTTP, detokenizing, streaming) over the
scheduler and an engine whose steps take a fixed time (a sleep without the GIL, as a step's wait on the device),
driven by `pegainfer bench serve` in another process on cores of its own (half the machine's, unless
--share-cores). Prints the output
tok/s against what the steps alone allow (steps x step time), the server process's CPU time per output token
(streaming, detokenizing, the scheduler, and each request's prompt encoded), and the steps' shapes.

    python3 scripts/gpu/random_checkpoint.py qwen3-4b /tmp/qwen3-4b-words --config-only
    python3 scripts/bench_server_host.py /tmp/qwen3-4b-words [--concurrency 256] [--step-ms 20] [--plain] \
        [--share-cores] [--timeout-keep-alive 5]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scheduler import InstantEngine  # noqa: E402

from pegainfer.argtypes import positive_float  # noqa: E402
from pegainfer.runtime.device_sampling import SampleResult  # noqa: E402
from pegainfer.runtime.engine_loop import EngineLoop  # noqa: E402
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from pegainfer.runtime.tokenizer import load_tokenizer  # noqa: E402
from pegainfer.server.app import ServerContext, build_app  # noqa: E402
from pegainfer.server.bench import whole_tokens  # noqa: E402
from pegainfer.server.cli import KEEP_ALIVE_S, SWITCH_INTERVAL_S  # noqa: E402
from pegainfer.server.metrics import Metrics  # noqa: E402

PORT = 8321


class TimedEngine(InstantEngine):
    """InstantEngine whose steps run one after another for `step_s` each from their launch, as on one stream,
    drawing ordinary tokens of the tokenizer."""

    def __init__(self, num_blocks: int, overlaps: bool, step_s: float, tokens: np.ndarray) -> None:
        super().__init__(num_blocks, overlaps)
        self.step_s, self.tokens, self.steps, self.busy_until = step_s, tokens, 0, 0.0
        self.first: float | None = None  # the first launch
        self.shapes: list[tuple[int, int]] = []  # each step's rows and tokens
        self.rng = np.random.default_rng(0)

    def launch(self, chunks, params, token_index, constraints=None, before_masks=None):
        super().launch(chunks, params, token_index, constraints)
        self.shapes.append((len(chunks), sum(c.num_tokens for c in chunks)))
        now = time.perf_counter()
        self.first = self.first or now
        done = self.busy_until = max(now, self.busy_until) + self.step_s
        self.steps += 1
        result = SampleResult(self.rng.choice(self.tokens, len(chunks)).tolist(), [None] * len(chunks))

        def read() -> SampleResult:
            time.sleep(max(0.0, done - time.perf_counter()))
            return result
        return read


def serve(args: argparse.Namespace) -> tuple[TimedEngine, "uvicorn.Server"]:
    tokenizer = load_tokenizer(args.checkpoint)
    config = json.loads((args.checkpoint / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    blocks = args.concurrency * -(-(args.prompt + args.output) // 16) + 1
    engine = TimedEngine(blocks, not args.plain, args.step_ms / 1e3, whole_tokens(tokenizer))
    scheduler = Scheduler(engine, tokenizer.eos_token_ids, SchedulerConfig(
        max_num_seqs=args.concurrency, max_num_batched_tokens=max(2048, args.concurrency),
        max_model_len=args.prompt + args.output + 1, async_scheduling=not args.plain))
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as `pegainfer serve` sets it
    loop = EngineLoop(scheduler, None, args.trace.open("w") if args.trace else None).start()
    ctx = ServerContext(loop, tokenizer, None, "bench", str(args.checkpoint), args.prompt + args.output + 1, vocab,
                        Metrics("bench"))
    server = uvicorn.Server(uvicorn.Config(build_app(ctx), port=PORT, log_level="warning",
                                           timeout_keep_alive=args.timeout_keep_alive))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():  # uvicorn gave up (its reason, such as the port in use, is on stderr)
            sys.exit(f"the server did not start on port {PORT}")
        time.sleep(0.05)
    return engine, server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a folder with config.json and the tokenizer's files")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=0, help="default: twice the concurrency")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--plain", action="store_true", help="--no-async-scheduling")
    parser.add_argument("--trace", type=Path, help="the engine loop's trace, a JSON line a step (--trace-steps)")
    parser.add_argument("--share-cores", action="store_true", help="server and client free on every core")
    parser.add_argument("--timeout-keep-alive", type=positive_float, default=KEEP_ALIVE_S,
                        help="as `pegainfer serve`'s")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    # the client must not take the server's cores, unless told to share them
    server_cores, client_cores = (cores, cores) if args.share_cores else (cores[:half] or cores, cores[half:])
    os.sched_setaffinity(0, server_cores)
    engine, server = serve(args)
    requests = args.requests or 2 * args.concurrency
    cpu = time.process_time()
    client = subprocess.run([sys.executable, "-m", "pegainfer.cli", "bench", "serve", "bench", "--base-url",
                             f"http://127.0.0.1:{PORT}", "--tokenizer", str(args.checkpoint),
                             "--input-len", str(args.prompt), "--output-len", str(args.output), "--num-prompts",
                             str(requests), "--max-concurrency", str(args.concurrency)],
                            capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, client_cores))
    cpu, steps, wall = time.process_time() - cpu, engine.steps, engine.busy_until - engine.first
    server.should_exit = True
    if client.returncode:
        sys.exit(f"bench serve failed ({client.returncode}): {client.stderr.strip()[-2000:]}")
    tokens = requests * args.output  # bench serve ignores EOS
    print(client.stdout.strip())
    print(f"{requests} requests at {args.concurrency}, {'plain' if args.plain else 'async'} steps of "
          f"{args.step_ms} ms: {steps} steps in {wall:.2f} s from the first launch to the last step's end "
          f"(the steps alone {steps * args.step_ms / 1e3:.2f} s), "
          f"{tokens / wall:,.0f} output tok/s; server CPU {cpu:.1f} s, {1e6 * cpu / tokens:.0f} us a token")
    shapes = np.array(engine.shapes)
    mixed = shapes[:, 1] > shapes[:, 0]
    for name, rows in (("decode", shapes[~mixed]), ("with a prompt chunk", shapes[mixed])):
        if len(rows):
            print(f"  steps {name}: {len(rows)}, {rows[:, 0].mean():.1f} rows, {rows[:, 1].mean():.0f} tokens a step")


if __name__ == "__main__":
    main()
