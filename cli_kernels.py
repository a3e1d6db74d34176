"""`pegainfer inspect`, `compile`, `tune` and `bench decode|prefill`: the commands over a model's kernel DAG and
its compiled kernels."""

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pegainfer.argtypes import int_list, non_negative_int, positive_int
from pegainfer.errors import PegainferError
from pegainfer.server.bench_cli import add_bench_serve_args, run_bench_serve
from pegainfer.server.cli import DTYPE_CHOICES, DTYPE_HELP, add_quantization_args
from pegainfer.server.engines import add_lora_args, add_parallel_args, add_speculative_arg, served_graphs

MODEL_HELP = "checkpoint folder, config.json, or an embedded config such as qwen3-4b"
CACHE_HELP = "cubin cache (default: $PEGAINFER_CACHE, aot_cache/ of a checkout, or ~/.cache/pegainfer)"


def add_kernel_commands(commands) -> None:
    add_inspect(commands)
    add_compile(commands)
    add_bench(commands)
    add_tune(commands)


def add_inspect(commands) -> None:
    p = commands.add_parser("inspect", help="print a model's graph, its passes or its kernels")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--show", choices=["graph", "passes", "dag", "kernels", *COMPILED_SHOWS],
                   default="kernels", help="graph: as declared; passes: the graph after each pass; dag: the "
                   "kernel DAG; kernels: the kernels a step launches (default), with --sm: which backend's "
                   "variant each kernel slot launches and by how much it won; with --sm: source, ptx, sass, "
                   "resources of the compiled kernels")
    p.add_argument("--sm", type=int, help="the SM whose compiled kernels to show (its manifest in the cache; "
                   "compiled first if there is none or it is corrupt)")
    p.add_argument("--kernel", help="for source, ptx, sass and resources: one kernel, by node name or kind "
                   "(default: all)")
    p.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP + "; with --sm")
    p.add_argument("--format", choices=["text", "dot", "svg"], default="text",
                   help="for graph and dag: text, Graphviz source, or SVG (needs Graphviz's dot on the PATH)")
    p.add_argument("--json", action="store_true", help="for kernels without --sm: one JSON object")
    add_quantization_args(p)
    add_parallel_args(p, executor=False)
    p.add_argument("--rank", type=non_negative_int, default=None,
                   help="with --tensor-parallel-size: the rank whose graph to show (default 0)")
    p.set_defaults(run=run_inspect, parser=p)


def add_compile(commands) -> None:
    p = commands.add_parser("compile", help="lower a model and compile its kernels to cubins, ahead of time")
    p.add_argument("model", help=MODEL_HELP + " (no weights needed)")
    p.add_argument("--sm", help="target SMs, e.g. 90 or 80,90,120 (default: the visible GPU's)")
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                   help="compiler processes (default: all cores)")
    p.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    p.add_argument("--backends", default=None, help="backends whose candidates to compile, e.g. triton or "
                   "triton,tilelang,cute (default: every one installed)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP.replace("on cuda", "(the "
                   "kernels are for GPUs)"))
    add_quantization_args(p)
    add_parallel_args(p, executor=False)
    add_lora_args(p, modules=False)  # the kernels of the model with LoRA tables, as serve --enable-lora runs it
    add_speculative_arg(p)  # eagle3 and mtp: the model giving its features and the head's graphs, as serve runs them
    p.add_argument("--dump-after", metavar="PASS", help="write the graph after PASS (or after each: all); with "
                   "--tensor-parallel-size, rank 0's")
    p.add_argument("--dump-dir", type=Path, default=Path("pegainfer-dumps"),
                   help="where --dump-after writes (default ./pegainfer-dumps)")
    p.set_defaults(run=run_compile, parser=p)


COMPILED_SHOWS = ("source", "ptx", "sass", "resources")


def _parallel(args: argparse.Namespace, rank: int):
    """Rank `rank`'s Parallelism under the flags (each checked: it applies with a size above 1)."""
    from pegainfer.passes.shard import Parallelism

    world, chosen = args.tensor_parallel_size, getattr(args, "rank", None)
    if world == 1 and (args.enable_expert_parallel or chosen is not None):
        args.parser.error(f"{'--rank' if chosen is not None else '--enable-expert-parallel'} applies with "
                          f"--tensor-parallel-size above 1")
    if chosen is not None and chosen >= world:
        args.parser.error(f"--rank {chosen}: expected a rank below --tensor-parallel-size {world}")
    return Parallelism(world, rank, args.enable_expert_parallel)


def _records(args: argparse.Namespace, parallel, **load) -> list:
    """A rank's pass records from the declared graph on, sharding among them (--show passes, --dump-after)."""
    from pegainfer.frontends.load import load_spec, resolve_config_path
    from pegainfer.passes.manager import run_passes
    from pegainfer.passes.pipeline import sharded_passes

    declared = load_spec(resolve_config_path(args.model), quantization=args.quantization,
                         kv_cache_dtype=args.kv_cache_dtype, **load)
    return run_passes(declared.graph, sharded_passes(parallel))[1]


def add_bench(commands) -> None:
    p = commands.add_parser("bench", help="time decode steps or a prefill on the GPU, against the floor; or load a "
                            "running server (serve)")
    p.add_argument("what", choices=["decode", "prefill", "serve"], help="decode: ms per step by batch and context; "
                   "prefill: by prompt length; serve: load a running OpenAI-compatible server")
    p.add_argument("model", nargs="?", help=MODEL_HELP + " (without weights: random bf16 weights); for serve: the "
                   "served model's name")
    p.add_argument("--batch", type=int_list, default=[1, 8, 32, 64], help="decode batch sizes (default 1,8,32,64)")
    p.add_argument("--context", type=int_list, default=[128, 1024], help="decode contexts (default 128,1024)")
    p.add_argument("--prompt-len", type=int_list, default=[1024, 4096, 8192], help="prefill prompt lengths")
    p.add_argument("--steps", type=positive_int, default=20, help="timed decode steps per point (default 20)")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly instead of replaying CUDA graphs")
    p.add_argument("--breakdown", action="store_true", help="also time each launch of a batch-1 decode step")
    p.add_argument("--pdl-max-tokens", type=non_negative_int, default=None,
                   help="programmatic dependent launch for steps of at most this many tokens, 0: never (default: "
                        "the engine's)")
    add_quantization_args(p)
    p.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--result-file", type=Path, default=None, metavar="FILE",
                   help="also write the JSON report to FILE, with the date, commit, card and command (a snapshot "
                        "for docs/benchmarks/)")
    add_bench_serve_args(p)
    p.set_defaults(run=run_bench, parser=p)


def add_tune(commands) -> None:
    p = commands.add_parser("tune", help="time each kernel's backend candidates on the GPU and keep the fastest")
    p.add_argument("model", help=MODEL_HELP + " (no weights needed)")
    p.add_argument("--cache-dir", type=Path, default=None, help=CACHE_HELP)
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                   help="compiler processes, if the model is not compiled yet (default: all cores)")
    p.set_defaults(run=run_tune, parser=p)


def run_inspect(args: argparse.Namespace) -> int:
    from pegainfer.frontends.kv_cache import kv_cache_summary
    from pegainfer.frontends.load import load_spec, resolve_config_path
    from pegainfer.passes.kernels import format_kernels, list_kernels
    from pegainfer.passes.pipeline import lower

    _check_inspect_flags(args)
    parallel = _parallel(args, args.rank or 0)
    device = "cuda" if args.sm is not None else "cpu"
    spec = load_spec(resolve_config_path(args.model), device=device, quantization=args.quantization,
                     kv_cache_dtype=args.kv_cache_dtype, parallel=parallel)
    if args.sm is not None:
        return _inspect_compiled(spec, args)
    if args.show == "graph":
        print(_drawing(spec.graph, args.format), end="")
        return 0
    lowered, records = lower(spec.graph)
    if args.show == "passes":
        records = _records(args, parallel, device=device) if parallel.sharded else records
        print("\n".join(record.dump() for record in records), end="")
    elif args.show == "dag":
        print(_drawing(lowered, args.format), end="")
    elif args.json:
        print(json.dumps({"model": spec.architecture, "dag_file": spec.dag_file,
                          "kernels": [k.as_json() for k in list_kernels(lowered)]}, indent=1))
    else:
        print(format_kernels(lowered), end="")
        print(kv_cache_summary(spec.graph))
    return 0


def _check_inspect_flags(args: argparse.Namespace) -> None:
    """A flag that does nothing for this --show is refused rather than ignored."""
    show, error = args.show, args.parser.error
    if show in COMPILED_SHOWS and args.sm is None:
        error(f"--show {show} needs --sm: the SM whose compiled kernels to show")
    if args.sm is not None and show in ("graph", "passes", "dag"):
        error(f"--sm applies to --show kernels, {', '.join(COMPILED_SHOWS)}; not to --show {show}")
    if args.format != "text" and show not in ("graph", "dag"):
        error(f"--format {args.format} applies to --show graph and dag; not to --show {show}")
    if args.json and (show != "kernels" or args.sm is not None):
        error(f"--json applies to --show kernels without --sm; not to --show {show}"
              + (" --sm" if args.sm is not None else ""))
    if args.kernel is not None and show not in COMPILED_SHOWS:
        error(f"--kernel applies to --show {', '.join(COMPILED_SHOWS)}; not to --show {show}")
    if args.cache_dir is not None and args.sm is None:
        error("--cache-dir applies with --sm: the cache of the compiled kernels to show")


def _drawing(graph, form: str) -> str:
    import shutil
    import subprocess

    from pegainfer.ir.printer import format_graph, to_dot

    if form == "text":
        return format_graph(graph)
    if form == "dot":
        return to_dot(graph)
    if shutil.which("dot") is None:
        raise PegainferError("--format svg needs Graphviz's `dot` on the PATH (apt-get install graphviz); "
                             "--format dot prints the source it would render")
    return subprocess.run(["dot", "-Tsvg"], input=to_dot(graph), capture_output=True, text=True, check=True).stdout


def _inspect_compiled(spec, args: argparse.Namespace) -> int:
    build = _import_build()
    from pegainfer.backends.cache import cache_root, manifest_path, read_manifest
    from pegainfer.backends.report import selection_table, show

    with _usage_errors(args):
        sm = build.parse_sms(str(args.sm))[0]
    manifest = manifest_path(cache_root(args.cache_dir), sm, spec)
    if read_manifest(manifest) is None:  # missing or corrupt: compiled as `pegainfer compile` would, every backend
        _writable_cache(args.cache_dir)
        manifest = build.build_model(spec, [sm], jobs=os.cpu_count() or 1, cache_dir=args.cache_dir,
                                     quiet=True).manifests[0]
    if args.show == "kernels":
        print(selection_table(manifest), end="")
    else:
        print(show(manifest, args.kernel, args.show), end="")
    return 0


# bench's own flags, by the modes they apply to (bench serve's are server/cli.py's)
BENCH_FLAGS = {"batch": ("--batch", ("decode",)), "context": ("--context", ("decode",)),
               "steps": ("--steps", ("decode",)), "no_graphs": ("--no-graphs", ("decode",)),
               "breakdown": ("--breakdown", ("decode",)), "pdl_max_tokens": ("--pdl-max-tokens", ("decode",)),
               "prompt_len": ("--prompt-len", ("prefill",)), "cache_dir": ("--cache-dir", ("decode", "prefill")),
               "quantization": ("--quantization", ("decode", "prefill")),
               "kv_cache_dtype": ("--kv-cache-dtype", ("decode", "prefill"))}


def run_bench(args: argparse.Namespace) -> int:
    for dest, (flag, modes) in BENCH_FLAGS.items():  # a flag given is one whose value is not its default
        if args.what not in modes and getattr(args, dest) != args.parser.get_default(dest):
            args.parser.error(f"{flag} applies to bench {' and '.join(modes)}; not to bench {args.what}")
    if args.what == "serve":
        return run_bench_serve(args)
    if args.model is None:
        raise PegainferError(f"bench {args.what} needs a MODEL: {MODEL_HELP}")
    from pegainfer.runtime import bench
    from pegainfer.runtime.device import visible_sm
    from pegainfer.runtime.gpu.start import ensure_manifest

    sm = visible_sm()
    if sm is None:
        raise PegainferError("pegainfer bench needs a visible GPU (and cuda-bindings: pip install -e '.[cuda]')")
    model = bench.bench_model(args.model, args.quantization, args.kv_cache_dtype)
    label = args.model + (f" --quantization {args.quantization}" if args.quantization else "") + \
        (f" --kv-cache-dtype {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "")
    manifest = ensure_manifest(model.spec, sm, args.cache_dir, label=label)  # compiled if missing
    if args.what == "decode":
        engine = bench.engine_for(model, manifest, max_tokens=max(args.batch), max_batch=max(args.batch),
                                  max_model_len=max(args.context) + args.steps + 16)
        if args.pdl_max_tokens is not None:
            engine.executor.pdl_max_tokens = args.pdl_max_tokens
        rows = bench.bench_decode(engine, args.batch, args.context, args.steps, graphs=not args.no_graphs)
        report = {"decode": bench.as_json(rows)}
        text = bench.format_decode(rows)
        if args.breakdown:
            report["breakdown_us"] = bench.kernel_breakdown(engine, args.context[0])
            text += "".join(f"{us:>9.0f} us  {name}\n" for name, us in report["breakdown_us"].items())
    else:
        engine = bench.engine_for(model, manifest, max_tokens=max(args.prompt_len), max_batch=1,
                                  max_model_len=max(args.prompt_len) + 16)
        rows = bench.bench_prefill(engine, args.prompt_len)
        report, text = {"prefill": bench.as_json(rows)}, bench.format_prefill(rows)
    if args.result_file:
        from pegainfer.runtime.snapshot import write_snapshot

        write_snapshot(args.result_file, report, engine.ctx.name(), args.argv)
    print(json.dumps(report, indent=1) if args.json else text, end="\n" if args.json else "")
    return 0


def run_compile(args: argparse.Namespace) -> int:
    from pegainfer.frontends.load import load_spec, resolve_config_path

    if args.dump_dir != args.parser.get_default("dump_dir") and not args.dump_after:
        args.parser.error("--dump-dir applies with --dump-after: the graphs to write there")
    build = _import_build()
    parallel = [_parallel(args, rank) for rank in range(args.tensor_parallel_size)]
    with _usage_errors(args):
        sms = build.parse_sms(args.sm) if args.sm else None
        backends = build.parse_backends(args.backends) if args.backends else None
        _check_pass_name(args.dump_after, parallel[0])
    specs = [load_spec(resolve_config_path(args.model), dtype=args.dtype, device="cuda",
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, parallel=p)
             for p in parallel]
    specs = served_graphs(args, specs)  # a drafter's features and head, LoRA tables, where the flags ask
    spec, sms = specs[0], sms or _visible_sm()
    if args.dump_after:
        written = _write_dumps(_records(args, parallel[0], dtype=args.dtype, device="cuda"), args.dump_dir,
                               args.dump_after)
        print(f"pegainfer: wrote {len(written)} dumps to {args.dump_dir}", file=sys.stderr)
    _writable_cache(args.cache_dir)
    report = build.build_models(specs, sms, jobs=args.jobs, cache_dir=args.cache_dir, backends=backends,
                                ranks=len(parallel))  # the rest: a draft head's graphs
    print(f"pegainfer: {spec.architecture} ({spec.config_path}): {report.summary()}", file=sys.stderr)
    for path in report.manifests:
        print(f"pegainfer: manifest {path}", file=sys.stderr)
    return 0


def run_tune(args: argparse.Namespace) -> int:
    from pegainfer.frontends.load import load_spec, resolve_config_path
    from pegainfer.runtime.device import visible_sm

    sm = visible_sm()
    if sm is None:
        raise PegainferError("pegainfer tune times kernels on a GPU and none is visible here (it also needs "
                             "cuda-bindings); without tuning data `pegainfer compile` uses each SM's default")
    from pegainfer.backends.cache import cache_root
    from pegainfer.backends.report import selection_table
    from pegainfer.backends.select import read_tuning, reselect
    from pegainfer.passes.pipeline import lower
    from pegainfer.runtime.cuda import driver
    from pegainfer.runtime.gpu.start import ensure_manifest
    from pegainfer.runtime.gpu.tune import tune

    spec = load_spec(resolve_config_path(args.model), device="cuda")
    root = cache_root(args.cache_dir)
    _writable_cache(args.cache_dir)
    manifest = ensure_manifest(spec, sm, args.cache_dir, label=args.model, jobs=args.jobs)  # compiled if missing
    path = tune(driver.Context.create(), manifest, lower(spec.graph)[0], root, spec,
                log=lambda line: print(line, file=sys.stderr))
    reselect(manifest, read_tuning(root, sm, spec))  # no compiler needed: the cubins are all in the manifest
    print(selection_table(manifest), end="")
    print(f"pegainfer: tuning written to {path}; manifest {manifest}", file=sys.stderr)
    return 0


def _visible_sm() -> list[int]:
    from pegainfer.runtime.device import visible_sm

    sm = visible_sm()
    if sm is None:
        raise PegainferError("no GPU is visible here: name the target with --sm, e.g. --sm 90 (H100/H200) or "
                             "--sm 80,90,120")
    return [sm]


def _check_pass_name(name: str | None, parallel) -> None:
    from pegainfer.passes.pipeline import sharded_passes

    names = [p.name for p in sharded_passes(parallel)]
    if name is not None and name != "all" and name not in names:
        raise PegainferError(f"--dump-after {name}: no such pass; passes: all, {', '.join(names)}")


def _write_dumps(records, folder: Path, which: str) -> list[Path]:
    from pegainfer.passes.manager import write_dumps

    if folder.exists() and not folder.is_dir():
        raise PegainferError(f"--dump-dir {folder}: exists and is not a folder (expected a folder for the dumps)")
    try:
        return write_dumps(records, folder, which)
    except OSError as error:
        raise PegainferError(f"--dump-dir {folder}: cannot write the dumps there ({error.strerror or error})") \
            from None


def _writable_cache(override: Path | None) -> Path:
    """The cubin cache, created now: compiler processes that cannot write it fail each with a traceback."""
    from pegainfer.backends.cache import cache_root

    root = cache_root(override)
    if root.exists() and not root.is_dir():
        raise PegainferError(f"cubin cache {root}: exists and is not a folder (choose another with --cache-dir)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise PegainferError(f"cubin cache {root}: cannot create it ({error.strerror or error}); choose another "
                             f"with --cache-dir") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise PegainferError(f"cubin cache {root}: not writable (choose another with --cache-dir)")
    return root


def _import_build():
    try:
        from pegainfer.backends import build
        from pegainfer.backends.triton.compiler import triton_version

        triton_version()  # from the package metadata: importing triton would fix compile-or-interpret mode
    except ImportError as error:
        raise PegainferError(f"compiling needs the compile extra ({error.name} is missing): "
                             f"pip install -e '.[compile]'") from None
    return build


@contextmanager
def _usage_errors(args: argparse.Namespace) -> Iterator[None]:
    """A bad flag value found past argparse (it needs a registry or an import to judge) is a usage error still."""
    try:
        yield
    except PegainferError as error:
        args.parser.error(str(error))
