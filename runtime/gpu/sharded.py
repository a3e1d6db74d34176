"""Rank 0's GPU engine of a model sharded over processes (runtime/sharded_engine.py): every step it is about to
launch, its packed inputs and plan, goes first to the workers, whose engines `execute` it (GpuEngine.on_step)."""

from dataclasses import replace
from pathlib import Path

import numpy as np

from pegainfer.frontends.load import LoadedModel
from pegainfer.frontends.lora import rank_rows
from pegainfer.runtime.gpu.engine import GpuEngine, StepPlan
from pegainfer.runtime.gpu.nccl import Rendezvous
from pegainfer.runtime.rank_workers import RankProcesses, RankSpec
from pegainfer.runtime.sharded_engine import RankDriver


class ShardedGpuEngine(RankDriver, GpuEngine):
    overlaps = False  # the workers get the packed step: a pending token's draw is copied on this device alone

    def __init__(self, spec: RankSpec, ranks: RankProcesses, model: LoadedModel, manifest: Path) -> None:
        self.spec, self.ranks = spec, ranks
        super().__init__(model, manifest, replace(spec.gpu, device=spec.gpu_device(0)),
                         Rendezvous(spec.nccl_id, spec.world, 0), on_step=self._forward)

    def _forward(self, step: dict[str, np.ndarray], plan: StepPlan) -> None:
        self._command("execute_plan", (step, plan))

    def write_lora(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        """An adapter's rows of the unsharded tables into one slot on every rank, each writing its part
        (rank_rows), in stream order before the steps that read them."""
        self._command("write_lora", (slot, rows))
        super().write_lora(slot, rank_rows(rows, self.graph))
