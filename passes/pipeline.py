"""The default pass pipeline, phase by phase, and `lower`: model graph -> kernel DAG."""

from pegainfer.ir.graph import Graph
from pegainfer.passes.absorb import absorb_latent_attention
from pegainfer.passes.cleanup import eliminate_common_subexpressions, eliminate_dead_code
from pegainfer.passes.fusion import (fuse_add_rms_norm, fuse_gemm_activation_epilogue, fuse_norm_prologue,
                                     fuse_qk_norm_rope_kv_write, fuse_weight_dequantize, plan_sampler_tail,
                                     split_residual_carry)
from pegainfer.passes.generic import fuse_elementwise_chains
from pegainfer.passes.kernels import form_kernels
from pegainfer.passes.lora import fuse_lora_update
from pegainfer.passes.manager import Pass, PassRecord, run_passes
from pegainfer.passes.memory import plan_memory
from pegainfer.passes.shard import Parallelism, tensor_parallel
from pegainfer.passes.weights import merge_sibling_linears

DEFAULT_PASSES = [
    Pass("eliminate_dead_code", "cleanup", eliminate_dead_code),
    Pass("eliminate_common_subexpressions", "cleanup", eliminate_common_subexpressions),
    Pass("merge_sibling_linears", "weight_transforms", merge_sibling_linears),
    Pass("absorb_latent_attention", "weight_transforms", absorb_latent_attention),
    Pass("fuse_lora_update", "fusion", fuse_lora_update),
    Pass("split_residual_carry", "fusion", split_residual_carry),
    Pass("fuse_add_rms_norm", "fusion", fuse_add_rms_norm),
    Pass("fuse_qk_norm_rope_kv_write", "fusion", fuse_qk_norm_rope_kv_write),
    Pass("fuse_gemm_activation_epilogue", "fusion", fuse_gemm_activation_epilogue),
    Pass("plan_sampler_tail", "fusion", plan_sampler_tail),
    Pass("fuse_norm_prologue", "fusion", fuse_norm_prologue),
    Pass("fuse_weight_dequantize", "fusion", fuse_weight_dequantize),
    Pass("fuse_elementwise_chains", "fusion", fuse_elementwise_chains),
    Pass("form_kernels", "kernel_formation", form_kernels),
    Pass("plan_memory", "memory_planning", plan_memory),
]


def sharded_passes(parallel: Parallelism) -> list[Pass]:
    """The default pipeline for one rank (tensor parallelism), sharding after clean-up."""
    if not parallel.sharded:
        return DEFAULT_PASSES
    cleanup = [p for p in DEFAULT_PASSES if p.phase == "cleanup"]
    return [*cleanup, tensor_parallel(parallel), *DEFAULT_PASSES[len(cleanup):]]


def shard_graph(graph: Graph, parallel: Parallelism) -> Graph:
    """One rank's graph before the weight transforms: clean-up and sharding (the default pipeline does the rest)."""
    passes = sharded_passes(parallel)
    return run_passes(graph, passes[: [p.phase for p in passes].index("sharding") + 1])[0]


def lower(graph: Graph, passes: list[Pass] | None = None) -> tuple[Graph, list[PassRecord]]:
    """The kernel DAG of a model graph, and the record of every pass."""
    return run_passes(graph, DEFAULT_PASSES if passes is None else passes)
