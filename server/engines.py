"""From a loaded model and `pegainfer serve`'s flags to the engine the scheduler drives: the reference engine on
the CPU, the compiled kernels on the GPU, or rank 0 of a model sharded over processes."""

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from pegainfer import argtypes
from pegainfer.errors import PegainferError

if TYPE_CHECKING:
    from pegainfer.frontends.load import LoadedModel, ModelSpec
    from pegainfer.frontends.lora import LoraConfig

EXECUTOR_BACKENDS = ("mp", "ray")  # runtime/rank_workers.py's BACKENDS, spelled out as DTYPE_CHOICES is
CPU_KV_TOKENS = 65536  # the reference engine's default pool: NumPy arrays, sized for trying the API
KV_BLOCK_SIZE = 16  # tokens a KV block holds, on either engine


def add_speculative_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM spells it: {"method": "ngram", "draft_model", "eagle3" or '
                        '"mtp", "num_speculative_tokens": K, "model": the draft model\'s or EAGLE-3 head\'s folder, '
                        '"prompt_lookup_min", "prompt_lookup_max" (ngram), "disable_by_batch_size"}; greedy and '
                        'seeded output is the same as without it')


def add_parallel_args(p: argparse.ArgumentParser, executor: bool = True) -> None:
    """vLLM's flags for a model sharded over several devices (passes/shard.py)."""
    p.add_argument("--tensor-parallel-size", "-tp", type=argtypes.positive_int, default=1,
                   help="ranks the model is sharded over, one process (and GPU) each (default 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: a MoE model's experts split whole across the ranks instead of "
                        "each expert split inside")
    if executor:
        p.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default="mp",
                       help="how the ranks past the first start: mp, processes of this machine (default); ray, "
                            "actors placed across the Ray cluster (`ray start`; RAY_ADDRESS, else a local one)")


def add_offload_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-offload-gb", type=float, default=0.0, metavar="GIB",
                   help="host memory for a second tier of the prefix cache: full cached blocks the KV pool evicts "
                        "are kept there and copied back on a later hit instead of recomputed (default 0: none)")


def host_tier(args: argparse.Namespace, engine):
    """--kv-offload-gb's tier over the engine's KV pool, or None; refused where it cannot serve."""
    if args.kv_offload_gb <= 0:
        return None
    if args.tensor_parallel_size > 1:
        raise PegainferError("--kv-offload-gb with --tensor-parallel-size is not implemented yet (every rank would "
                             "copy its part of a block): serve it on one rank")
    if not args.prefix_cache or engine.allocator.state_slots:
        raise PegainferError("--kv-offload-gb keeps prefix-cache blocks: it needs the prefix cache, and a model "
                             "without recurrent layers")
    from pegainfer.runtime.host_tier import HostTier, host_capacity

    return HostTier(engine, host_capacity(args.kv_offload_gb, engine.kv_bytes_per_block()), KV_BLOCK_SIZE)


def add_lora_args(p: argparse.ArgumentParser, modules: bool = True) -> None:
    """vLLM's LoRA flags (`modules`: the adapters served at start, which compile has no use for)."""
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters beside the base model: a request's model names one (its rows run with "
                        "it, batched with others'); POST /v1/load_lora_adapter and /v1/unload_lora_adapter at run "
                        "time")
    if modules:
        p.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
                       help="PEFT adapter folders served at start, each under its name (needs --enable-lora)")
    p.add_argument("--max-loras", type=argtypes.positive_int, default=1,
                   help="adapters held in the engine's tables at once; more are swapped in as requests need them "
                        "(default 1)")
    p.add_argument("--max-lora-rank", type=argtypes.positive_int, default=16,
                   help="the highest adapter rank served; higher ones are refused (default 16)")


def lora_module(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, found {text!r}")
    return name, Path(path)


def lora_config(args: argparse.Namespace) -> "LoraConfig | None":
    """The LoRA tables' sizes where --enable-lora asks for them; --lora-modules without it refused."""
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        raise PegainferError("--lora-modules needs --enable-lora")
    if not args.enable_lora:
        return None
    from pegainfer.frontends.lora import LoraConfig

    return LoraConfig(args.max_loras, args.max_lora_rank)


def served_graphs(args: argparse.Namespace, specs: list["ModelSpec"]) -> list["ModelSpec"]:
    """The graphs `serve` runs under these flags, for `pegainfer compile` (the specs: a model's ranks): the model
    giving the features a hidden-state drafter reads and the head's graphs after the ranks (--speculative-config),
    LoRA tables on the ranks (--enable-lora)."""
    from dataclasses import replace

    ranks = len(specs)
    if args.speculative_config:
        from pegainfer.runtime.drafter_graphs import compiled_drafter

        specs = compiled_drafter(args.speculative_config, specs)
    if (lora := lora_config(args)) is not None:
        from pegainfer.frontends.lora import with_lora

        specs = [replace(s, graph=with_lora(s.graph, lora)) if i < ranks else s for i, s in enumerate(specs)]
    return specs


def build_engine(model: "LoadedModel", device: str, args: argparse.Namespace, max_model_len: int, step_tokens: int):
    """The reference engine on the CPU; on the GPU, the compiled kernels (compiled first if missing)."""
    lora = lora_config(args)
    if args.tensor_parallel_size > 1:  # with LoRA: each rank's tables hold its part
        return build_sharded_engine(model, device, args, max_model_len, step_tokens, lora)
    if device == "cpu":
        from pegainfer.frontends.lora import with_lora
        from pegainfer.runtime.reference_engine import ReferenceEngine

        return ReferenceEngine(model, max_tokens=cpu_kv_tokens(args, max_model_len), block_size=KV_BLOCK_SIZE,
                               max_seqs=args.max_num_seqs,
                               state_snapshots=state_snapshots(args), spare_states=spare_states(args),
                               graph=with_lora(model.spec.graph, lora) if lora else None)
    from pegainfer.frontends.lora import lora_model
    from pegainfer.runtime.gpu.start import gpu_engine

    if lora is not None:  # its own manifest: the kernels of the LoRA'd graph (backends/cache.py model_id)
        model = lora_model(model, lora)
    options = gpu_options(args, model, max_model_len, step_tokens)
    return gpu_engine(model, options, args.cache_dir)  # without --kv-cache-tokens: the KV cache fills the utilization


def gpu_options(args: argparse.Namespace, model: "LoadedModel", max_model_len: int, step_tokens: int):
    """The GPU engine's options from serve's flags (a sharded model's every rank takes the same): with speculation,
    a row of logits for each draft (no more than a step's tokens), spare state rows to roll back to, and with a
    draft model or head the memory its engines take beside this one (proposers.draft_reserve)."""
    from pegainfer.runtime.gpu.engine import EngineOptions
    from pegainfer.runtime.speculative import parse_speculative_config

    speculative = parse_speculative_config(args.speculative_config) if args.speculative_config else None
    drafts = speculative.num_speculative_tokens if speculative else 0
    reserved, share = (0, 1.0)
    if speculative is not None and speculative.method != "ngram" and args.kv_cache_tokens is None:
        from pegainfer.runtime.proposers import draft_reserve  # the drafter's engines are built beside this one

        reserved, share = draft_reserve(speculative, model, args.dtype)
    return EngineOptions(max_tokens=step_tokens, max_batch=args.max_num_seqs, max_model_len=max_model_len,
                         kv_tokens=args.kv_cache_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
                         block_size=KV_BLOCK_SIZE, state_snapshots=state_snapshots(args),
                         spare_states=spare_states(args),
                         max_samples=max(args.max_num_seqs, min(step_tokens, args.max_num_seqs * (drafts + 1))),
                         verify_tokens=drafts and drafts + 1, reserved_bytes=reserved, kv_share=share)


def build_sharded_engine(model: "LoadedModel", device: str, args: argparse.Namespace, max_model_len: int,
                         step_tokens: int, lora: "LoraConfig | None" = None):
    """Rank 0 of a model sharded over --tensor-parallel-size processes, the others started by the executor backend;
    with `lora`, every rank's LoRA tables of its part (its own manifest on a GPU)."""
    from pegainfer.runtime.rank_workers import RankSpec
    from pegainfer.runtime.sharded_engine import start_sharded_engine

    spec = RankSpec(str(model.folder), args.tensor_parallel_size, args.enable_expert_parallel, args.dtype, device,
                    args.quantization, args.kv_cache_dtype,
                    cpu_kv_tokens(args, max_model_len), KV_BLOCK_SIZE,
                    args.max_num_seqs, state_snapshots(args), spare_states(args),
                    gpu=gpu_options(args, model, max_model_len, step_tokens) if device == "cuda" else None,
                    cache_dir=args.cache_dir and str(args.cache_dir), lora=lora)
    return start_sharded_engine(spec, args.distributed_executor_backend, model)


def cpu_kv_tokens(args: argparse.Namespace, max_model_len: int) -> int:
    """The reference engine's KV pool in tokens: --kv-cache-tokens, else enough for every sequence up to a cap."""
    return args.kv_cache_tokens or min(CPU_KV_TOKENS, args.max_num_seqs * max_model_len)


def spare_states(args: argparse.Namespace) -> int:
    """Rows of recurrent state a speculating sequence rolls back to: one a sequence when speculating."""
    return args.max_num_seqs if args.speculative_config else 0


def state_snapshots(args: argparse.Namespace) -> int:
    """Rows of recurrent state kept for the prefix cache: none without it."""
    if not args.prefix_cache:
        return 0
    return args.max_num_seqs if args.state_snapshots is None else args.state_snapshots


def engine_thread_init(engine):
    """For the GPU engine: make its CUDA context current in the engine loop's thread."""
    ctx = getattr(engine, "ctx", None)
    if ctx is None:
        return None

    def bind() -> None:
        from cuda.bindings import driver as cuda

        from pegainfer.runtime.cuda.driver import check

        check(cuda.cuCtxSetCurrent(ctx.context), "cuCtxSetCurrent")
    return bind
