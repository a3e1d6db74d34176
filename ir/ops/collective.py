"""Collectives over the ranks of a sharded graph (passes/shard.py places them): every rank holds a piece of a
value, and the op combines the pieces. Sums run in float32 in rank order, so every rank computes the same bits;
the result is rounded to the declared dtype like any other op's. On the GPU they are NCCL's calls."""

from functools import reduce

import numpy as np

from pegainfer.ir.ranks import current_rank
from pegainfer.ir.registry import COLLECTIVE, expect, register_op
from pegainfer.ir.types import TensorType


def _check_world(op: str, world: int) -> None:
    expect(isinstance(world, int) and world > 1, f"{op}: world must be an int of at least 2 ranks, found {world!r}")


def _int_axis(op: str, x: TensorType, axis: int, world: int, divides: bool) -> int:
    expect(isinstance(axis, int) and -x.rank <= axis < x.rank, f"{op}: axis {axis!r} out of range for {x}")
    size = x.shape[axis]
    expect(isinstance(size, int) and (not divides or size % world == 0),
           f"{op}: axis {axis} of {x} must be a fixed size{f' divisible by {world} ranks' if divides else ''}")
    return axis % x.rank


def _infer_all_reduce(x: TensorType, *, world: int) -> TensorType:
    _check_world("all_reduce", world)
    expect(x.dtype.is_float, f"all_reduce: sums float values, found {x}")
    return x


def _all_reduce(x: np.ndarray, *, world: int) -> np.ndarray:
    """The sum over ranks of each rank's x (partial sums of a row-parallel GEMM)."""
    group, rank = current_rank("all_reduce", world)
    return reduce(np.add, [np.asarray(a, np.float32) for a in group.exchange(rank, x)])


def _infer_all_gather(x: TensorType, *, world: int, axis: int = -1) -> TensorType:
    _check_world("all_gather", world)
    axis = _int_axis("all_gather", x, axis, world, divides=False)
    return x.with_shape(tuple(d * world if i == axis else d for i, d in enumerate(x.shape)))


def _all_gather(x: np.ndarray, *, world: int, axis: int = -1) -> np.ndarray:
    """Every rank's x concatenated along `axis` in rank order."""
    group, rank = current_rank("all_gather", world)
    return np.concatenate(group.exchange(rank, x), axis=axis)


def _infer_reduce_scatter(x: TensorType, *, world: int, axis: int = -1) -> TensorType:
    _check_world("reduce_scatter", world)
    axis = _int_axis("reduce_scatter", x, axis, world, divides=True)
    return x.with_shape(tuple(d // world if i == axis else d for i, d in enumerate(x.shape)))


def _reduce_scatter(x: np.ndarray, *, world: int, axis: int = -1) -> np.ndarray:
    """This rank's part (the rank-th of `world` along `axis`) of the sum over ranks."""
    group, rank = current_rank("reduce_scatter", world)
    total = reduce(np.add, [np.asarray(a, np.float32) for a in group.exchange(rank, x)])
    return np.split(total, world, axis=axis)[rank]


def _infer_all_to_all(x: TensorType, *, world: int) -> TensorType:
    _check_world("all_to_all", world)
    expect(x.rank >= 1, f"all_to_all: exchanges rows, found {x}")
    expect(not isinstance(x.shape[0], int) or x.shape[0] % world == 0,
           f"all_to_all: {x}'s rows must divide into {world} equal parts")
    return x


def _all_to_all(x: np.ndarray, *, world: int) -> np.ndarray:
    """x's rows cut into `world` equal parts, part j sent to rank j; what rank i sent comes i-th (expert
    dispatch: each part a destination's fixed-capacity rows)."""
    group, rank = current_rank("all_to_all", world)
    if len(x) % world:
        raise ValueError(f"all_to_all: {len(x)} rows do not divide into {world} equal parts")
    return np.concatenate([np.split(a, world)[rank] for a in group.exchange(rank, x)])


register_op("all_reduce", _infer_all_reduce, _all_reduce, COLLECTIVE)
register_op("all_gather", _infer_all_gather, _all_gather, COLLECTIVE)
register_op("reduce_scatter", _infer_reduce_scatter, _reduce_scatter, COLLECTIVE)
register_op("all_to_all", _infer_all_to_all, _all_to_all, COLLECTIVE)
