"""NCCL for the ranks of a sharded model, one process and GPU each, through nccl4py's low-level bindings (the `cuda`
extra; the library comes from nvidia-nccl-cu13): a unique id made by one process and sent to the others (bytes,
picklable), a communicator per rank from (id, world, rank) made with the rank's CUDA context current, and the
collectives queued on a CUDA stream (capturable into CUDA graphs). NVLink multicast (NVLS) stays off unless the
environment says otherwise, and connections are made when the communicator is, not in the first captured step."""

import os
from dataclasses import dataclass
from types import ModuleType

from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import DType, dtype_from_name
from pegainfer.runtime.cuda import driver

# NCCL reads these when a communicator is made; a value the environment gives is kept
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0",  # no multicast objects (cuMulticastCreate): NVLS is not ours to use
                 "NCCL_RUNTIME_CONNECT": "0"}  # connect at init: a first collective inside a graph capture cannot
_DTYPES = {"bf16": "Bfloat16", "f16": "Float16", "f32": "Float32", "i32": "Int32", "i64": "Int64",
           "f8e4m3": "Float8e4m3", "f8e5m2": "Float8e5m2"}
WARM_UP_BYTES = 4096


def _nccl() -> ModuleType:
    """nccl4py's bindings, NCCL_DEFAULTS set first (NCCL reads its settings once, at its first call)."""
    for name, value in NCCL_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        from nccl.bindings import nccl
    except ImportError:
        raise PegainferError("tensor parallelism on the GPU needs nccl4py (pip install -e '.[cuda]')") from None
    return nccl


def _call(what: str, function, *args):
    """An NCCL call; its error (or the library's absence) as one line naming the call."""
    nccl = _nccl()
    try:
        return function(*args)
    except nccl.NCCLError as error:
        raise PegainferError(f"NCCL {what} failed: {error}") from None
    except RuntimeError as error:  # cuda.pathfinder's: no libnccl.so.2 (the nvidia-nccl-cu13 wheel brings it)
        raise PegainferError(f"NCCL {what}: {error}") from None


@dataclass(frozen=True)
class Rendezvous:
    """What every rank's engine joins by: the unique id rank 0 made (sent to the others as bytes), world, rank."""
    unique_id: bytes
    world: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise PegainferError(f"rank {self.rank} of {self.world}: expected 0 <= rank < world")


def make_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes): made once, by the driver process, and given to every rank."""
    return bytes(_call("ncclGetUniqueId", _nccl().get_unique_id))


class NcclCommunicator:
    """One rank's NCCL communicator: its collectives queued on a stream (runtime/gpu/collectives.py's
    Communicator)."""

    def __init__(self, rendezvous: Rendezvous, stream=None) -> None:
        """Joins the other ranks (blocks until all have called it); the CUDA context of this rank's GPU must be
        current. With `stream`, one all-reduce and all-gather run there first, waited for."""
        nccl = _nccl()
        self.world, self.rank = rendezvous.world, rendezvous.rank
        self.handle = _call("ncclCommInitRank", nccl.comm_init_rank, self.world, bytearray(rendezvous.unique_id),
                            self.rank)
        self._lib, self._sum = nccl, int(nccl.RedOp.Sum)
        if stream is not None:
            self.warm_up(stream)

    def all_reduce(self, src: int, dst: int, count: int, dtype: DType, stream) -> None:
        _call("ncclAllReduce", self._lib.all_reduce, src, dst, count, _dtype(dtype), self._sum, self.handle,
              int(stream))

    def all_gather(self, src: int, dst: int, count: int, dtype: DType, stream) -> None:
        _call("ncclAllGather", self._lib.all_gather, src, dst, count, _dtype(dtype), self.handle, int(stream))

    def reduce_scatter(self, src: int, dst: int, count: int, dtype: DType, stream) -> None:
        _call("ncclReduceScatter", self._lib.reduce_scatter, src, dst, count, _dtype(dtype), self._sum, self.handle,
              int(stream))

    def all_to_all(self, src: int, dst: int, count: int, dtype: DType, stream) -> None:
        _call("ncclAlltoAll", self._lib.allto_all, src, dst, count, _dtype(dtype), self.handle, int(stream))

    def warm_up(self, stream) -> None:
        """A first all-reduce and all-gather, eagerly: any set-up NCCL leaves to its first calls happens here,
        not inside a step's graph capture, and a broken link shows now."""
        from cuda.bindings import driver as cu

        f32 = dtype_from_name("f32")
        buffer = driver.alloc(WARM_UP_BYTES * (self.world + 1))
        try:
            count = WARM_UP_BYTES // 4
            self.all_reduce(buffer, buffer, count, f32, stream)
            self.all_gather(buffer, buffer + WARM_UP_BYTES, count, f32, stream)
            driver.check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        finally:
            driver.free(buffer)

    def abort(self) -> None:
        """Ends the communicator from any thread, its queued collectives failing rather than waiting forever for a
        rank that is gone (a worker's death)."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            _call("ncclCommAbort", self._lib.comm_abort, handle)

    def close(self) -> None:
        if self.handle is not None:
            _call("ncclCommDestroy", self._lib.comm_destroy, self.handle)
            self.handle = None


def _dtype(dtype: DType) -> int:
    if dtype.name not in _DTYPES:
        raise PegainferError(f"NCCL carries {', '.join(_DTYPES)}; found {dtype.name}")
    return int(getattr(_nccl().DataType, _DTYPES[dtype.name]))
