"""One rank's slices of checkpoint tensors (Graph.shards, made by passes/shard.py): taken from arrays in memory,
or read from a safetensors file touching only the slice's bytes, so that each of N ranks reads about 1/N of the
checkpoint."""

import os
from collections.abc import Mapping
from math import prod

import numpy as np

from pegainfer.errors import CheckpointError
from pegainfer.ir.graph import Shard


def take_shard(array: np.ndarray, shard: Shard) -> np.ndarray:
    """This rank's slice of a whole tensor, zero-padded where the shard says."""
    index = [slice(None)] * array.ndim
    index[shard.axis] = slice(shard.start, shard.stop)
    part = array[tuple(index)]
    if not shard.pad:
        return np.ascontiguousarray(part)
    widths = [(0, 0)] * array.ndim
    widths[shard.axis] = (0, shard.pad)
    return np.pad(part, widths)


def shard_weights(weights: Mapping[str, np.ndarray], shards: Mapping[str, Shard]) -> dict[str, np.ndarray]:
    """A rank's checkpoint tensors from the whole ones: sharded ones sliced, the rest as they are."""
    return {name: take_shard(array, shards[name]) if name in shards else array for name, array in weights.items()}


def check_divides(name: str, shape: tuple[int, ...], shard: Shard) -> None:
    """The stored tensor is the one the shard was cut from."""
    if tuple(shape) != tuple(shard.full.shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(shape)}, expected {list(shard.full.shape)} to take "
                              f"rows {shard.start}:{shard.stop} of axis {shard.axis} for this rank")


def read_shard(path: os.PathLike, offset: int, shape: tuple[int, ...], dtype: np.dtype, shard: Shard,
               name: str) -> np.ndarray:
    """The slice of a row-major tensor stored at `offset` of `path`, read with one pread per contiguous run: the
    whole slice at once along axis 0, a run per outer index along an inner axis."""
    check_divides(name, shape, shard)
    dtype = np.dtype(dtype)
    outer, inner = prod(shape[: shard.axis]), prod(shape[shard.axis + 1:])
    run = (shard.stop - shard.start) * inner * dtype.itemsize
    stride = shape[shard.axis] * inner * dtype.itemsize
    first = offset + shard.start * inner * dtype.itemsize
    out = np.empty(outer * run, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        for index in range(outer):
            got = os.preadv(fd, [memoryview(out)[index * run: (index + 1) * run]], first + index * stride)
            if got != run:
                raise CheckpointError(f"{path}: tensor {name!r} ends early ({got} of {run} bytes at its slice)")
    finally:
        os.close(fd)
    local = list(shape)
    local[shard.axis] = shard.stop - shard.start
    part = out.view(dtype).reshape(local)
    return take_shard(part, Shard(shard.axis, 0, local[shard.axis], shard.full, shard.pad)) if shard.pad else part
