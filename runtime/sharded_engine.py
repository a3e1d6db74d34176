"""The engine of a model sharded over processes, as the scheduler sees it: rank 0's engine, which sends each step's
packed inputs (and each state copy) to the other ranks before running its own graph; the ranks' collectives meet
over their links. Only rank 0 packs, samples and keeps the block tables: the workers follow its steps."""

from collections.abc import Callable
from pathlib import Path

import numpy as np

from pegainfer.errors import PegainferError
from pegainfer.frontends.load import LoadedModel, load_model
from pegainfer.ir.ranks import bound_rank
from pegainfer.runtime.rank_workers import RankProcesses, RankSpec, start_ranks
from pegainfer.runtime.reference_engine import ReferenceEngine


class ShardedEngine(ReferenceEngine):
    def __init__(self, spec: RankSpec, ranks: RankProcesses, model: LoadedModel) -> None:
        """`model`: rank 0's (load_rank_model)."""
        super().__init__(model, max_tokens=spec.kv_tokens, block_size=spec.block_size, max_seqs=spec.max_seqs,
                         state_snapshots=spec.state_snapshots, spare_states=spec.spare_states)
        self.spec, self.ranks = spec, ranks

    @property
    def world(self) -> int:
        return self.spec.world

    def watch(self, on_failure: Callable[[BaseException], None]) -> None:
        """`on_failure` hears of a worker's exit when it happens, also between steps."""
        self.ranks.on_failure = on_failure

    def execute(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        self._command("execute", inputs)
        try:
            with bound_rank(self.ranks.links, 0):
                return super().execute(inputs)
        except BaseException:
            self.shutdown()  # the workers wait in a collective that will not complete: release them
            raise

    def copy_state(self, src: int, dst: int) -> None:
        self._command("copy_state", (src, dst))
        super().copy_state(src, dst)

    def shutdown(self) -> None:
        self.ranks.stop()

    def _command(self, command: str, payload) -> None:
        if self.ranks.error is not None:
            raise self.ranks.error
        self.ranks.links.send_all(command, payload)


def load_rank_model(spec: RankSpec, rank: int, lazy: bool = False) -> LoadedModel:
    return load_model(Path(spec.folder), lazy=lazy, dtype=spec.dtype, device=spec.device,
                      quantization=spec.quantization, kv_cache_dtype=spec.kv_cache_dtype, parallel=spec.parallel(rank))


def start_sharded_engine(spec: RankSpec, backend: str = "mp", model: LoadedModel | None = None) -> ShardedEngine:
    """The workers load their parts while rank 0 reads its own (`model`, loaded here if not given); all are stopped
    if any fails."""
    if spec.device != "cpu":
        raise PegainferError("--tensor-parallel-size on cuda is not served yet (the rank graphs compile with "
                             "`pegainfer compile --tensor-parallel-size`): run a sharded model with --device cpu")
    ranks = start_ranks(spec, backend)
    try:
        engine = ShardedEngine(spec, ranks, model or load_rank_model(spec, 0))
        ranks.wait_ready()
    except BaseException:
        ranks.stop()
        raise
    return engine
