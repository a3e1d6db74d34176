"""The worker ranks of a sharded model: one process each, started by multiprocessing on this machine (vLLM's `mp`
executor) or as Ray actors placed by a placement group across the Ray cluster (`ray`). Each loads its own rank's
graph and slices of the checkpoint, connects back to the driver (runtime/rank_links.py) and runs the steps the
driver sends it until the driver goes away. A watcher thread reports a worker that exits, so that a dead worker
fails the engine (health 503) instead of hanging it."""

import multiprocessing
import multiprocessing.connection
import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pegainfer.errors import PegainferError
from pegainfer.frontends.lora import LoraConfig, rank_rows
from pegainfer.ir.ranks import bound_rank
from pegainfer.passes.shard import Parallelism
from pegainfer.runtime.rank_links import FAILED, READY, DriverLinks, RankFailed, WorkerLink

BACKENDS = ("mp", "ray")  # --distributed-executor-backend
START_TIMEOUT_S = 600.0  # loading a rank's slices of a large checkpoint


@dataclass(frozen=True)
class Ranks:
    """How a command asked its model to be sharded: --tensor-parallel-size, --enable-expert-parallel and
    --distributed-executor-backend."""
    size: int = 1
    expert_parallel: bool = False
    backend: str = "mp"


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds its part of the engine from: the checkpoint, how it is loaded, the layout and the
    engine's sizes (the same on every rank, so that their KV pools and state rows match the driver's tables)."""
    folder: str
    world: int
    expert_parallel: bool = False
    dtype: str = "auto"
    device: str = "cpu"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    kv_tokens: int = 8192
    block_size: int = 16
    max_seqs: int = 256
    state_snapshots: int | None = None
    spare_states: int = 0
    gpu: Any = None  # on cuda: the GPU engine's EngineOptions (the device is each rank's)
    nccl_id: bytes | None = None  # on cuda: the NCCL unique id the driver made
    cache_dir: str | None = None  # on cuda: the cubin cache holding every rank's manifest
    backend: str = "mp"  # how the workers were started: a Ray actor sees only its own GPU (device 0)
    lora: LoraConfig | None = None  # with --enable-lora: the LoRA tables' sizes

    def parallel(self, rank: int) -> Parallelism:
        return Parallelism(self.world, rank, self.expert_parallel)

    def gpu_device(self, rank: int) -> int:
        return rank if self.backend == "mp" else 0

    def reference_sizes(self) -> dict:
        """The CPU engine's sizes (ReferenceEngine's keywords), alike on every rank."""
        return dict(max_tokens=self.kv_tokens, block_size=self.block_size, max_seqs=self.max_seqs,
                    state_snapshots=self.state_snapshots, spare_states=self.spare_states)


def load_rank_engine(spec: RankSpec, rank: int):
    """Rank `rank`'s engine: its graph and weights on the CPU engine, or on its GPU joined to the others by NCCL."""
    from pegainfer.runtime.sharded_engine import load_rank_model, rank_graph, rank_model

    if spec.device == "cuda":
        from pegainfer.runtime.gpu.nccl import Rendezvous
        from pegainfer.runtime.gpu.start import gpu_engine

        options = replace(spec.gpu, device=spec.gpu_device(rank))
        model = rank_model(spec, load_rank_model(spec, rank, lazy=True))
        return gpu_engine(model, options, spec.cache_dir and Path(spec.cache_dir),
                          communicator=Rendezvous(spec.nccl_id, spec.world, rank))
    from pegainfer.runtime.reference_engine import ReferenceEngine

    model = load_rank_model(spec, rank)
    return ReferenceEngine(model, graph=rank_graph(spec, model), **spec.reference_sizes())


def serve_rank(spec: RankSpec, rank: int, address: tuple[str, int], authkey: bytes) -> None:
    """A worker's life: connect, load, then run the driver's commands until it goes away."""
    link = WorkerLink(address, authkey, rank, spec.world)
    try:
        engine = load_rank_engine(spec, rank)
        link.send(READY, getattr(engine, "kv_blocks", None))  # a GPU rank's pool, which the driver may cut
        with bound_rank(link, rank):
            while True:
                command, payload = link.receive()
                if command == "execute":  # the CPU engine's packed inputs
                    engine.execute(payload)
                elif command == "execute_plan":  # a GPU engine's step and its plan (eager or which graph)
                    engine.execute(*payload)
                elif command == "copy_state":
                    engine.copy_state(*payload)
                elif command == "write_lora":  # the unsharded tables' rows: this rank keeps its part
                    slot, rows = payload
                    engine.write_lora(slot, rank_rows(rows, engine.graph))
                elif command == "limit_kv_blocks":
                    engine.limit_kv_blocks(payload)
                elif command == "stop":
                    return
                else:
                    raise AssertionError(f"unknown command {command!r}")
    except EOFError:  # the driver is gone
        return
    except BaseException as error:  # noqa: BLE001  the driver must hear why, not wait for a rank that is gone
        try:
            link.send(FAILED, f"{type(error).__name__}: {error}" if isinstance(error, PegainferError)
                      else traceback.format_exc(limit=-3).strip())
        except OSError:
            pass
    finally:
        link.close()


class RankProcesses:
    """The worker ranks of one engine, however they were started: their links, and a watch over their lives."""

    def __init__(self, links: DriverLinks, dead: Callable[[], str | None], wait_any: Callable[[], str],
                 stop: Callable[[], None], pids: Callable[[], list[int]]) -> None:
        """`dead`: why a worker is gone, or None while all run; `wait_any` blocks until one is gone and says why."""
        self.links, self.dead, self._wait_any, self._stop, self.pids = links, dead, wait_any, stop, pids
        self.error: RankFailed | None = None
        self._stopping = False
        self.on_failure: Callable[[BaseException], None] | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> list:
        """Until every worker has loaded its part and connected; then their lives are watched. Returns what each
        said it was ready with (a GPU rank's KV blocks)."""
        try:
            ready = self.links.accept(self.dead, timeout)
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._watch, name="pegainfer-rank-watch", daemon=True).start()
        return ready

    def _watch(self) -> None:
        why = self._wait_any()
        if self._stopping:
            return
        self.error = RankFailed(f"a worker rank exited: {why}")
        if self.on_failure is not None:
            self.on_failure(self.error)

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self.links.send_all("stop")
        except RankFailed:
            pass
        self.links.close()
        self._stop()


def start_ranks(spec: RankSpec, backend: str) -> RankProcesses:
    """Starts ranks 1 .. world - 1 loading their parts (wait_ready waits for them)."""
    if backend not in BACKENDS:
        raise PegainferError(f"--distributed-executor-backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    starter = _start_processes if backend == "mp" else _start_ray_actors
    return starter(spec)


def _start_processes(spec: RankSpec) -> RankProcesses:
    links = DriverLinks(spec.world)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no engine thread or CUDA context forked
    processes = [context.Process(target=serve_rank, args=(spec, rank, links.address, links.authkey), daemon=True,
                                 name=f"pegainfer-rank-{rank}") for rank in range(1, spec.world)]
    for process in processes:
        process.start()

    def dead() -> str | None:
        gone = [p for p in processes if p.exitcode is not None]
        return f"{gone[0].name} (pid {gone[0].pid}) exit code {gone[0].exitcode}" if gone else None

    def wait_any() -> str:
        ready = multiprocessing.connection.wait([p.sentinel for p in processes])
        for process in processes:
            if process.sentinel in ready:
                process.join(1)  # reaped, so that its exit code is known
        return dead() or "unknown"

    def stop() -> None:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
    return RankProcesses(links, dead, wait_any, stop, lambda: [p.pid for p in processes])


def _start_ray_actors(spec: RankSpec) -> RankProcesses:
    from pegainfer.runtime import ray_ranks

    return ray_ranks.start_actors(spec)


def rank_environment() -> dict[str, str]:
    """The variables a worker must see as the driver does (NCCL's settings among them)."""
    return {name: value for name, value in os.environ.items() if name.startswith(("NCCL_", "PEGAINFER_"))}
