"""From a loaded model and `pegainfer serve`'s flags to the engine the scheduler drives: the reference engine on
the CPU, the compiled kernels on the GPU, or rank 0 of a model sharded over processes."""

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pegainfer.frontends.load import LoadedModel

CPU_KV_TOKENS = 65536  # the reference engine's default pool: NumPy arrays, sized for trying the API
KV_BLOCK_SIZE = 16  # tokens a KV block holds, on either engine


def build_engine(model: "LoadedModel", device: str, args: argparse.Namespace, max_model_len: int, step_tokens: int):
    """The reference engine on the CPU; on the GPU, the compiled kernels (compiled first if missing)."""
    if args.tensor_parallel_size > 1:
        return build_sharded_engine(model, device, args, max_model_len)
    if device == "cpu":
        from pegainfer.runtime.reference_engine import ReferenceEngine

        tokens = args.kv_cache_tokens or min(CPU_KV_TOKENS, args.max_num_seqs * max_model_len)
        return ReferenceEngine(model, max_tokens=tokens, block_size=KV_BLOCK_SIZE, max_seqs=args.max_num_seqs,
                               state_snapshots=state_snapshots(args), spare_states=spare_states(args))
    from pegainfer.runtime.gpu.engine import EngineOptions
    from pegainfer.runtime.gpu.start import gpu_engine

    options = EngineOptions(max_tokens=step_tokens, max_batch=args.max_num_seqs, max_model_len=max_model_len,
                            kv_tokens=args.kv_cache_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
                            block_size=KV_BLOCK_SIZE, state_snapshots=state_snapshots(args))
    return gpu_engine(model, options, args.cache_dir)  # without --kv-cache-tokens: the KV cache fills the utilization


def build_sharded_engine(model: "LoadedModel", device: str, args: argparse.Namespace, max_model_len: int):
    """Rank 0 of a model sharded over --tensor-parallel-size processes, the others started by the executor backend."""
    from pegainfer.runtime.rank_workers import RankSpec
    from pegainfer.runtime.sharded_engine import start_sharded_engine

    spec = RankSpec(str(model.folder), args.tensor_parallel_size, args.enable_expert_parallel, args.dtype, device,
                    args.quantization, args.kv_cache_dtype,
                    args.kv_cache_tokens or min(CPU_KV_TOKENS, args.max_num_seqs * max_model_len), KV_BLOCK_SIZE,
                    args.max_num_seqs, state_snapshots(args), spare_states(args))
    return start_sharded_engine(spec, args.distributed_executor_backend, model)


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
