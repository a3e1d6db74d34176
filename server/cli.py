"""`pegainfer serve` and `pegainfer bench serve`: their flags, and the wiring from a checkpoint folder to a
listening server (model, tokenizer, chat template, engine, scheduler, engine loop, HTTP app)."""

import argparse
import errno
import importlib
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TextIO

from pegainfer import argtypes
from pegainfer.errors import PegainferError
from pegainfer.server.engines import (CPU_KV_TOKENS, KV_BLOCK_SIZE, add_lora_args, add_offload_arg, add_parallel_args,
                                      add_speculative_arg, build_engine, engine_thread_init, host_tier, lora_config)

if TYPE_CHECKING:  # the serving stack is imported inside the functions: `pegainfer --help` stays fast
    from pegainfer.frontends.load import LoadedModel
    from pegainfer.runtime.engine_loop import EngineLoop
    from pegainfer.server.app import ServerContext

SWITCH_INTERVAL_S = 0.0002  # the GIL's: how soon a thread that waited without it (the engine's) gets it back
KEEP_ALIVE_S = 75.0  # nginx's default; uvicorn's 5 s lost requests sent on a connection it was closing
# frontends/load.py's DTYPE_CHOICES, spelled out so that the CLI's start does not import NumPy for every command
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
# server/tool_parsers.py's and server/reasoning.py's registries, spelled out as DTYPE_CHOICES is
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# frontends/quantization.py's QUANTIZATION_CHOICES, spelled out as DTYPE_CHOICES is
QUANTIZATION_CHOICES = ("fp8",)
QUANTIZATION_HELP = ("fp8: the projections stored and read as float8 e4m3, a scale per output channel computed at "
                     "load (the embedding and LM head as stored; sm_89 or newer on cuda). Default: none, or the "
                     "checkpoint's own quantization_config")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # frontends/kv_cache.py's, spelled out as DTYPE_CHOICES is
KV_CACHE_DTYPE_HELP = ("auto (default): the KV cache in the model's dtype; fp8 (or fp8_e4m3): float8 e4m3, half the "
                       "bytes, with a scale per layer for keys and values (the checkpoint's k_scale / v_scale, else "
                       "1.0; sm_89 or newer on cuda)")
DTYPE_HELP = ("weights and activations: auto (default) is config.json's torch_dtype, except that a float32 "
              "checkpoint runs as bfloat16 on cuda (vLLM's rule); bfloat16, float16 or float32 cast the weights "
              "on load")


def add_quantization_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None, help=QUANTIZATION_HELP)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help=KV_CACHE_DTYPE_HELP)


def add_serve(commands) -> None:
    p = commands.add_parser("serve", help="serve a checkpoint behind an OpenAI-compatible HTTP API")
    p.add_argument("--model-path", "--model", dest="model_path", type=Path, required=True,
                   help="Hugging Face checkpoint folder, or a Hugging Face model id such as Qwen/Qwen3-4B (read "
                        "from the hub cache, downloaded unless HF_HUB_OFFLINE is set)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=argtypes.port, default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the model id as given for "
                                               "a Hugging Face id, else the folder's name)")
    p.add_argument("--api-key", default=os.environ.get("PEGAINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $PEGAINFER_API_KEY, else none)")
    p.add_argument("--max-num-seqs", type=argtypes.positive_int, default=256,
                   help="sequences in a batch at most (default 256, as vLLM)")
    p.add_argument("--max-model-len", type=argtypes.positive_int, default=None,
                   help="prompt + completion tokens at most (default: config.json's max_position_embeddings)")
    p.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=2048,
                   help="tokens in one engine step at most: the chunked-prefill budget (default 2048)")
    p.add_argument("--gpu-memory-utilization", type=argtypes.fraction, default=0.9,
                   help="fraction of GPU memory for weights, KV cache and activations (default 0.9)")
    p.add_argument("--kv-cache-tokens", type=argtypes.positive_int, default=None,
                   help=f"KV cache size in tokens, instead of sizing it from GPU memory (cpu default {CPU_KV_TOKENS} "
                        f"or max-num-seqs x max-model-len if smaller)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not share the KV blocks of common prompt prefixes")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="read each step's tokens before the next step is launched (by default the next is launched "
                        "first where the requests allow it, so that the host's work overlaps the GPU's)")
    p.add_argument("--state-snapshots", type=argtypes.non_negative_int, default=None,
                   help="for models with recurrent layers: their state kept at this many cached block boundaries "
                        "for prefix hits (default: max-num-seqs; 0 turns the prefix cache off for them)")
    p.add_argument("--max-seqs-per-request", type=argtypes.positive_int, default=256,
                   help="prompts x n of one request at most; more is refused with a 400 (default 256)")
    p.add_argument("--max-request-bytes", type=argtypes.positive_int, default=8 << 20,
                   help="largest request body accepted (default 8 MiB)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cuda: the compiled kernels; cpu: the reference executor (slow; for trying the API). "
                        "Default: cuda if present, else cpu")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    add_quantization_args(p)
    add_parallel_args(p)
    add_speculative_arg(p)
    add_lora_args(p)
    add_offload_arg(p)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="cubin cache (see pegainfer compile); kernels missing there are compiled at start when "
                        "the compile extra is installed")
    p.add_argument("--trace-steps", type=Path, default=None, metavar="FILE",
                   help="write a JSON line per engine step to FILE: its sequences and tokens, the engine's seconds "
                        "and the serving loop's own (to profile a slow server)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide to call the request's tools (tool_choice auto); needs "
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                   help="how tool calls are read from the model's text and forced into it (tool_choice required "
                        "or a named function): hermes (Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3), mistral")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split a thinking model's <think>...</think> into reasoning_content: qwen3, deepseek_r1")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: a request's sampling defaults (temperature, top_p, top_k, min_p) from the "
                        "checkpoint's generation_config.json, as vLLM does; vllm: the neutral ones")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level (default warning)")
    p.add_argument("--timeout-keep-alive", type=argtypes.positive_float, default=KEEP_ALIVE_S,
                   help=f"seconds an idle connection stays open (default {KEEP_ALIVE_S:g}: past a load balancer's "
                        f"60, so a client reusing it seldom sends a request as the server closes it)")
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    trace = open_trace(args.trace_steps)  # before the slow part: a path that cannot be written fails at once
    listener = bind_listener(args.host, args.port)  # so does a port in use: the socket is handed to uvicorn
    loop = None
    try:
        loop, ctx, ready_line = start_serving(args, trace, listener)
        serve_http(ctx, listener, args.log_level, args.timeout_keep_alive, ready_line)
    finally:
        listener.close()
        if loop is not None:
            loop.stop()
            if hasattr(loop.scheduler.engine, "shutdown"):  # a sharded engine's worker ranks
                loop.scheduler.engine.shutdown()
        if trace is not None:
            trace.close()
    return 0


def start_serving(args: argparse.Namespace, trace: TextIO | None, listener: socket.socket
                  ) -> tuple["EngineLoop", "ServerContext", Callable[[], str]]:
    """Model, engine, tokenizer, scheduler and engine loop: (the loop, the app's context, a function that makes
    the ready line once the HTTP server listens)."""
    from pegainfer.frontends.hub import resolve_checkpoint
    from pegainfer.frontends.load import load_model
    from pegainfer.passes.shard import Parallelism
    from pegainfer.runtime.device import choose_device
    from pegainfer.runtime.speculative import parse_speculative_config

    phases = {"imports": process_age()}
    speculative = parse_speculative_config(args.speculative_config) if args.speculative_config else None
    device, reason = choose_device(args.device)
    checkpoint = resolve_checkpoint(args.model_path)
    parallel = Parallelism(args.tensor_parallel_size, 0, args.enable_expert_parallel)
    model = load_model(checkpoint.folder, lazy=device == "cuda" or parallel.sharded, dtype=args.dtype, device=device,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, parallel=parallel)
    from pegainfer.runtime.drafter_graphs import drafting_target

    model = drafting_target(speculative, model, device, parallel.sharded)
    max_model_len, explicit = _max_model_len(model.spec.raw_config, args.max_model_len)
    if args.kv_cache_tokens is not None:  # the pool's size is known: refuse before the slow part
        fit_model_len(max_model_len, explicit, -(-args.kv_cache_tokens // KV_BLOCK_SIZE) * KV_BLOCK_SIZE)
    step_tokens = max(args.max_num_batched_tokens, args.max_num_seqs)
    phases["model"] = process_age() - sum(phases.values())
    engine, tokenizer = load_engine_and_tokenizer(args, model, device, max_model_len, step_tokens, phases)
    allocator = engine.allocator
    max_model_len, clamp_note = fit_model_len(max_model_len, explicit, allocator.num_blocks * allocator.block_size)

    from pegainfer.runtime.chat import load_chat_template
    from pegainfer.runtime.engine_loop import EngineLoop
    from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig
    from pegainfer.runtime.tokenizer import sampling_defaults
    from pegainfer.server.app import ServerContext
    from pegainfer.server.metrics import Metrics

    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=step_tokens,
                             max_model_len=max_model_len, prefix_cache=args.prefix_cache,
                             async_scheduling=args.async_scheduling)
    chat_template = load_chat_template(checkpoint.folder)  # before the loop's thread starts: it may be refused
    # The engine thread waits on the GPU without the GIL once a step; under load the event loop holds it then, and
    # hands it back only at the switch interval (5 ms by default, which would add up to that to every step)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    speculator, lora_slots, lora, lora_paths, host, spec_note = serving_features(args, speculative, model, device,
                                                                                 engine)
    scheduler = Scheduler(engine, tokenizer.eos_token_ids, config, speculator, lora_slots, host)
    loop = EngineLoop(scheduler, engine_thread_init(engine), trace).start()
    ranks_note = ""
    if hasattr(engine, "watch"):  # a sharded engine: a worker rank's death fails the loop even between steps
        engine.watch(loop.fail)
        ranks_note = (f"; {engine.world} ranks{' (experts split whole)' if args.enable_expert_parallel else ''} over "
                      f"{args.distributed_executor_backend}, worker pids {' '.join(map(str, engine.ranks.pids()))}")
    name = args.served_model_name or checkpoint.name
    cache_info = {"cache_dtype": args.kv_cache_dtype}
    if device == "cuda" and args.kv_cache_tokens is None:
        cache_info["gpu_memory_utilization"] = args.gpu_memory_utilization
    metrics = Metrics(name, max_model_len=max_model_len, cache_info=cache_info)
    ctx = ServerContext(loop, tokenizer, chat_template, name, checkpoint.repo_id or str(args.model_path),
                        max_model_len, model.spec.config.vocab_size, metrics, args.api_key,
                        args.max_request_bytes, args.max_seqs_per_request, args.tool_call_parser,
                        args.enable_auto_tool_choice, args.reasoning_parser,
                        sampling_defaults(checkpoint.folder) if args.generation_config == "auto" else {},
                        lora, lora_paths)

    def ready_line() -> str:
        ctx.metrics.startup_seconds = process_age()
        phases["http"] = ctx.metrics.startup_seconds - sum(phases.values())
        cache_dtype = " in fp8" if args.kv_cache_dtype != "auto" else ""
        overlap = "on" if scheduler.overlap else "off"
        return (f"pegainfer: serving {name} on http://{_address(listener)} (device {device}: {reason}; dtype "
                f"{model.spec.config.torch_dtype}{ranks_note}; {allocator.num_blocks} KV blocks of "
                f"{allocator.block_size} tokens{cache_dtype}; max_model_len {max_model_len}{clamp_note}; prefix cache "
                f"{scheduler.prefix_cache_status()}; async scheduling {overlap}{spec_note}); "
                f"ready {ctx.metrics.startup_seconds:.2f} s after start "
                f"({', '.join(f'{k} {v:.2f} s' for k, v in phases.items())})")
    return loop, ctx, ready_line


def serving_features(args: argparse.Namespace, speculative, model: "LoadedModel", device: str, engine) -> tuple:
    """What runs beside the engine where the flags ask: the speculator, the LoRA slots with the routes' service and
    the adapters served, the host KV tier, and their part of the ready line."""
    speculator = None
    if speculative is not None:
        from pegainfer.runtime.proposers import make_speculator

        speculator = make_speculator(speculative, model, device, engine.allocator.num_blocks * KV_BLOCK_SIZE,
                                     args.max_num_seqs, args.dtype, engine, args.cache_dir)
    lora_slots, lora, lora_paths = serve_adapters(args, engine)
    host = host_tier(args, engine)
    note = "" if speculative is None else \
        f"; speculative decoding: {speculative.method}, {speculative.num_speculative_tokens} tokens"
    if lora is not None:
        note += f"; LoRA adapters {', '.join(lora_paths) or '(none yet)'} in {args.max_loras} slots"
    if host is not None:
        note += f"; host KV tier of {host.capacity} blocks"
    return speculator, lora_slots, lora, lora_paths, host, note


def serve_adapters(args: argparse.Namespace, engine) -> tuple:
    """--enable-lora's slots over the engine's tables with --lora-modules registered, the routes' service, and
    name -> folder of those served; (None, None, {}) without it."""
    config = lora_config(args)
    if config is None:
        return None, None, {}
    from pegainfer.frontends.lora import read_adapter
    from pegainfer.runtime.lora import LoraSlots
    from pegainfer.server.lora_routes import LoraService

    slots = LoraSlots(engine.graph, config, engine.write_lora)
    for name, path in args.lora_modules:
        slots.register(read_adapter(name, path, engine.graph, config))
    return slots, LoraService(engine.graph, config), {name: str(path) for name, path in args.lora_modules}


def serve_http(ctx: "ServerContext", listener: socket.socket, log_level: str, keep_alive_s: float,
               ready_line: Callable[[], str]) -> None:
    """uvicorn on the socket bound at start; the ready line is printed once it accepts connections there."""
    import uvicorn

    from pegainfer.server.app import build_app

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(ready_line(), file=sys.stderr, flush=True)

    config = uvicorn.Config(build_app(ctx), log_level=log_level, timeout_keep_alive=keep_alive_s,
                            timeout_graceful_shutdown=5)
    Server(config).run(sockets=[listener])


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening: connections are refused until the server is ready,
    as vLLM does); every way it can fail is one line naming the address."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise PegainferError(f"--host {host}: cannot resolve it to an address ({error.strerror})") from None
    family, kind, proto, _, address = min(found, key=lambda entry: entry[0] != socket.AF_INET)  # uvicorn's IPv4 first
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds past the last one's TIME_WAIT
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        why = {errno.EADDRINUSE: "the address is already in use (another server? choose another --port)",
               errno.EADDRNOTAVAIL: "that address is not one of this machine's (see --host)",
               errno.EACCES: "permission denied (ports below 1024 need privileges)"}.get(error.errno, error.strerror)
        raise PegainferError(f"cannot listen on {_host_port(host, port)}: {why}") from None
    return sock


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return _host_port(host, port)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def load_engine_and_tokenizer(args: argparse.Namespace, model: "LoadedModel", device: str, max_model_len: int,
                              step_tokens: int, phases: dict[str, float]):
    """The weights stream to the device (I/O and copies, outside the GIL) in a worker thread while this one imports
    the HTTP stack and reads the tokenizer: start-up is the longer of the two, not their sum."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="pegainfer-load") as pool:
        building = pool.submit(build_engine, model, device, args, max_model_len, step_tokens)
        for module in ("uvicorn", "pegainfer.server.app"):  # imported during the load; serve_http uses them
            importlib.import_module(module)
        from pegainfer.runtime.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model.folder)
        phases["http stack and tokenizer"] = process_age() - sum(phases.values())
        engine = building.result()
    phases["engine, beyond that"] = process_age() - sum(phases.values())
    return engine, tokenizer


def open_trace(path: Path | None) -> TextIO | None:
    if path is None:
        return None
    try:
        return path.open("w", encoding="utf-8")
    except OSError as error:
        raise PegainferError(f"--trace-steps: cannot write {path}: {error.strerror}") from None


def fit_model_len(max_model_len: int, explicit: bool, pool_tokens: int) -> tuple[int, str]:
    """(max_model_len, a note for the ready line) once the KV pool's size is known: one sequence must fit in it,
    as vLLM requires; a length given with --max-model-len that does not is refused, a defaulted one clamped."""
    if max_model_len <= pool_tokens:
        return max_model_len, ""
    if explicit:
        raise PegainferError(f"--max-model-len {max_model_len} is more than the KV cache holds ({pool_tokens} tokens "
                             f"in blocks of {KV_BLOCK_SIZE}): lower --max-model-len, or give the cache more room "
                             f"with --kv-cache-tokens or --gpu-memory-utilization")
    return pool_tokens, f" (max_position_embeddings {max_model_len}, clamped to the KV cache)"


def _max_model_len(raw_config: dict, requested: int | None) -> tuple[int, bool]:
    """(the length, whether --max-model-len gave it): a default may be clamped to the KV cache later."""
    limit = raw_config.get("max_position_embeddings")
    if requested is not None and limit is not None and requested > limit:
        raise PegainferError(f"--max-model-len {requested} is past this model's max_position_embeddings {limit}")
    return requested or limit or 2048, requested is not None


def process_age() -> float:
    """Seconds since this process started, from the kernel's own record of it (so interpreter start-up and
    imports count)."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.process_time()
