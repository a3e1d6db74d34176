"""The engine of a model sharded over processes, as the scheduler sees it: rank 0's engine, which sends each step
(and each state copy) to the other ranks before running its own. On the CPU engine a step is its packed inputs and
the ranks' collectives meet over their links; on the GPU it is the packed inputs and the launch plan (eager, or a
decode bucket's CUDA graph), every rank issuing the same NCCL calls. Only rank 0 packs, samples and keeps the block
tables: the workers follow its steps."""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from pegainfer.frontends.load import LoadedModel, load_model
from pegainfer.frontends.lora import lora_model, rank_rows, with_lora
from pegainfer.ir.graph import Graph
from pegainfer.ir.ranks import bound_rank
from pegainfer.runtime.rank_workers import RankProcesses, RankSpec, start_ranks
from pegainfer.runtime.reference_engine import ReferenceEngine


class RankDriver:
    """What rank 0's engine adds to itself, on either engine: the workers, told of every step and state copy."""
    spec: RankSpec
    ranks: RankProcesses

    @property
    def world(self) -> int:
        return self.spec.world

    def watch(self, on_failure: Callable[[BaseException], None]) -> None:
        """`on_failure` hears of a worker's exit when it happens, also between steps; a GPU engine's NCCL
        communicator is aborted first, so that a step waiting on the dead rank fails instead of hanging."""
        def failed(error: BaseException) -> None:
            abort = getattr(getattr(self, "communicator", None), "abort", None)
            if abort is not None:
                abort()
            on_failure(error)
        self.ranks.on_failure = failed

    def copy_state(self, src: int, dst: int) -> None:
        self._command("copy_state", (src, dst))
        super().copy_state(src, dst)

    def shutdown(self) -> None:
        self.ranks.stop()

    def _command(self, command: str, payload) -> None:
        if self.ranks.error is not None:
            raise self.ranks.error
        self.ranks.links.send_all(command, payload)


class ShardedEngine(RankDriver, ReferenceEngine):
    def __init__(self, spec: RankSpec, ranks: RankProcesses, model: LoadedModel) -> None:
        """`model`: rank 0's (load_rank_model); with `spec.lora`, its graph gains LoRA tables of its part."""
        super().__init__(model, graph=rank_graph(spec, model), **spec.reference_sizes())
        self.spec, self.ranks = spec, ranks

    def write_lora(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        """An adapter's rows of the unsharded tables (frontends/lora.adapter_rows) into one slot on every rank,
        each cutting them to its part of the tables (rank_rows)."""
        self._command("write_lora", (slot, rows))
        super().write_lora(slot, rank_rows(rows, self.graph))

    def execute(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        self._command("execute", inputs)
        try:
            with bound_rank(self.ranks.links, 0):
                return super().execute(inputs)
        except BaseException:
            self.shutdown()  # the workers wait in a collective that will not complete: release them
            raise


def rank_graph(spec: RankSpec, model: LoadedModel) -> Graph:
    """A rank's graph: its model's, with LoRA tables on its own projections (each rank's part of them) where
    `spec.lora` asks for adapters."""
    return with_lora(model.spec.graph, spec.lora) if spec.lora is not None else model.spec.graph


def rank_model(spec: RankSpec, model: LoadedModel) -> LoadedModel:
    """The model a rank's GPU engine runs (and takes its manifest by): rank_graph's graph over its weights."""
    return lora_model(model, spec.lora) if spec.lora is not None else model


def load_rank_model(spec: RankSpec, rank: int, lazy: bool = False) -> LoadedModel:
    return load_model(Path(spec.folder), lazy=lazy, dtype=spec.dtype, device=spec.device,
                      quantization=spec.quantization, kv_cache_dtype=spec.kv_cache_dtype, parallel=spec.parallel(rank))


def start_sharded_engine(spec: RankSpec, backend: str = "mp", model: LoadedModel | None = None):
    """The workers load their parts while rank 0 reads its own (`model`, loaded here if not given); all are stopped
    if any fails. On cuda the ranks' KV pools are cut to the smallest one's blocks, so every block table holds on
    every rank."""
    spec = replace(spec, backend=backend)
    if spec.device == "cuda":
        from pegainfer.runtime.gpu.nccl import make_unique_id

        spec = replace(spec, nccl_id=make_unique_id())
    ranks = start_ranks(spec, backend)
    try:
        model = model or load_rank_model(spec, 0, lazy=spec.device == "cuda")
        engine = ShardedEngine(spec, ranks, model) if spec.device == "cpu" else sharded_gpu_engine(spec, ranks, model)
        pools = ranks.wait_ready()
        if spec.device == "cuda":
            fewest = min([engine.kv_blocks, *pools])
            ranks.links.send_all("limit_kv_blocks", fewest)
            engine.limit_kv_blocks(fewest)
    except BaseException:
        ranks.stop()
        raise
    return engine


def sharded_gpu_engine(spec: RankSpec, ranks: RankProcesses, model: LoadedModel):
    """Rank 0's GPU engine (runtime/gpu/sharded.py): its context current in this thread, NCCL joined as the
    workers join."""
    from pegainfer.runtime.device import visible_sm
    from pegainfer.runtime.gpu.sharded import ShardedGpuEngine
    from pegainfer.runtime.gpu.start import ensure_manifest

    model = rank_model(spec, model)
    manifest = ensure_manifest(model.spec, visible_sm(), spec.cache_dir and Path(spec.cache_dir),
                               label=str(model.folder))
    return ShardedGpuEngine(spec, ranks, model, manifest)
