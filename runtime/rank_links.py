"""The links between the ranks of a model sharded over processes (or Ray actors, on several machines): one
authenticated socket from each worker rank to the driver (rank 0). It carries the driver's commands, a worker's
failure, and the collectives' arrays: a collective gathers every rank's array at the driver, which sends the whole
list back, so that every rank reduces the same arrays in the same order (ir/ops/collective.py). On the GPU the
collectives are NCCL's; these links then carry only the commands."""

import os
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

import numpy as np

from pegainfer.errors import PegainferError

EXCHANGE, FAILED, READY = "exchange", "failed", "ready"
ACCEPT_POLL_S = 0.5  # how often the driver, waiting for workers to connect, checks that they are still alive


class RankFailed(PegainferError):
    """A worker rank died or failed; the sharded engine cannot run another step."""


class DriverLinks:
    """Rank 0's ends of the links, one per worker rank, in rank order once `accept` has run."""

    def __init__(self, world: int, host: str = "127.0.0.1") -> None:
        self.world = world
        self.authkey = os.urandom(32)
        self._server = socket.create_server((host, 0))
        self._server.settimeout(ACCEPT_POLL_S)
        self.address = self._server.getsockname()[:2]
        self._links: list[Connection] = []
        self._dead: Callable[[], str | None] = lambda: None

    def accept(self, dead: Callable[[], str | None], timeout: float) -> list[Any]:
        """Waits for every worker to connect and say it is ready (its model loaded), returning what each said;
        `dead` names a worker that exited meanwhile, which fails the start at once rather than after `timeout`."""
        self._dead = dead
        links: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout
        while len(links) < self.world - 1:
            why = dead()
            if why is not None:
                raise RankFailed(f"a worker rank exited before it was ready: {why}")
            if time.monotonic() > deadline:
                raise RankFailed(f"{self.world - 1 - len(links)} of {self.world - 1} worker ranks did not connect "
                                 f"within {timeout:.0f} s")
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                continue
            sock.settimeout(None)
            link = Connection(sock.detach())
            deliver_challenge(link, self.authkey)
            answer_challenge(link, self.authkey)
            rank = link.recv()
            links[rank] = link
        self._server.close()
        self._links = [links[rank] for rank in range(1, self.world)]
        return [self.receive(rank, READY) for rank in range(1, self.world)]

    def send_all(self, command: str, payload: Any = None) -> None:
        for rank, link in enumerate(self._links, start=1):
            try:
                link.send((command, payload))
            except OSError as error:
                raise RankFailed(f"worker rank {rank} is gone ({error.strerror or error})") from None

    def receive(self, rank: int, kind: str) -> Any:
        """The next message from `rank`, which must be of `kind`; a worker's failure or death raises."""
        try:
            got, payload = self._links[rank - 1].recv()
        except (EOFError, OSError):
            why = self._dead()
            raise RankFailed(f"worker rank {rank} died{f': {why}' if why else ''}") from None
        if got == FAILED:
            raise RankFailed(f"worker rank {rank} failed: {payload}")
        assert got == kind, f"rank {rank} sent {got!r} where {kind!r} was due"
        return payload

    def exchange(self, rank: int, array: np.ndarray) -> list[np.ndarray]:
        """The driver's side of a collective (ir/ranks.Exchange)."""
        assert rank == 0, f"the driver is rank 0, not {rank}"
        arrays = [array, *(self.receive(r, EXCHANGE) for r in range(1, self.world))]
        self.send_all(EXCHANGE, arrays)
        return arrays

    def close(self) -> None:
        self._server.close()
        for link in self._links:
            link.close()


class WorkerLink:
    """A worker rank's end of its link to the driver."""

    def __init__(self, address: tuple[str, int], authkey: bytes, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        sock = socket.create_connection(address)
        self._link = Connection(sock.detach())
        answer_challenge(self._link, authkey)
        deliver_challenge(self._link, authkey)
        self._link.send(rank)

    def send(self, kind: str, payload: Any = None) -> None:
        self._link.send((kind, payload))

    def receive(self) -> tuple[str, Any]:
        """The driver's next command; EOFError once the driver is gone."""
        return self._link.recv()

    def exchange(self, rank: int, array: np.ndarray) -> list[np.ndarray]:
        """A worker's side of a collective (ir/ranks.Exchange)."""
        assert rank == self.rank, f"link of rank {self.rank} used by rank {rank}"
        self.send(EXCHANGE, array)
        kind, arrays = self.receive()
        assert kind == EXCHANGE, f"the driver sent {kind!r} during a collective"
        return arrays

    def close(self) -> None:
        self._link.close()
