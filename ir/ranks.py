"""The ranks of a sharded graph run as threads of one process, so that sharding is proven on the CPU: each rank
runs its own graph through the reference interpreter, and a collective op is a rendezvous of all of them. Ranks
in processes of their own (runtime/rank_links.py) bind a group of the same shape to the thread that runs their
graph."""

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from pegainfer.errors import GraphError
from pegainfer.ir.graph import Graph
from pegainfer.ir.interpreter import run_graph

RENDEZVOUS_TIMEOUT_S = 600.0  # a rank that never arrives (a graph with fewer collectives) fails the others
_local = threading.local()


class Exchange(Protocol):
    """What a collective needs of its ranks: each rank leaves its array and takes every rank's, in rank order."""
    world: int

    def exchange(self, rank: int, array: np.ndarray) -> list[np.ndarray]: ...


class RankGroup:
    """`world` ranks as threads exchanging arrays: each leaves its own and takes every rank's, in rank order."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._slots: list[np.ndarray | None] = [None] * world
        self._barrier = threading.Barrier(world, timeout=RENDEZVOUS_TIMEOUT_S)

    def exchange(self, rank: int, array: np.ndarray) -> list[np.ndarray]:
        self._slots[rank] = array
        self._wait()
        arrays = list(self._slots)
        self._wait()  # nobody leaves its next array before every rank has read this round's
        return arrays

    def abort(self) -> None:
        self._barrier.abort()

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise GraphError("a collective's rendezvous broke: another rank failed or never arrived") from None


@contextmanager
def bound_rank(group: Exchange, rank: int) -> Iterator[None]:
    """The calling thread runs graphs as `rank` of `group` while inside."""
    _local.group, _local.rank = group, rank
    try:
        yield
    finally:
        _local.group = _local.rank = None


def current_rank(op: str, world: int) -> tuple[Exchange, int]:
    """The group and rank of the thread running a collective; an error outside run_ranks or in a group of
    another size."""
    group, rank = getattr(_local, "group", None), getattr(_local, "rank", None)
    if group is None:
        raise GraphError(f"{op}: no rank group: a sharded graph runs under ir.ranks.run_ranks, one thread a rank")
    if group.world != world:
        raise GraphError(f"{op}: the node is for {world} ranks, the group has {group.world}")
    return group, rank


def run_ranks(graphs: Sequence[Graph], inputs: Mapping[str, np.ndarray], weights: Sequence[Mapping[str, np.ndarray]],
              states: Sequence[Mapping[str, np.ndarray]]) -> list[list[np.ndarray]]:
    """Every rank's outputs: rank r runs graphs[r] over the same inputs with its own weights and states."""
    world = len(graphs)
    assert len(weights) == len(states) == world, "one graph, weights and states per rank"
    group = RankGroup(world)
    results: list[list[np.ndarray] | None] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def run(rank: int) -> None:
        try:
            with bound_rank(group, rank):
                results[rank] = run_graph(graphs[rank], inputs, weights[rank], states[rank])
        except BaseException as error:  # noqa: BLE001  reported below, after every thread has stopped
            errors[rank] = error
            group.abort()

    threads = [threading.Thread(target=run, args=(rank,), name=f"rank-{rank}") for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((e for e in errors if e is not None and not _is_broken(e)), None) or \
        next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results  # type: ignore[return-value]


def _is_broken(error: BaseException) -> bool:
    return isinstance(error, GraphError) and "rendezvous broke" in str(error)
