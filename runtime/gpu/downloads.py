"""Device tensors back to the host: a step's small outputs together through one pinned landing area, and any
tensor alone (a view of rows narrower than their stride cut to its columns)."""

from collections.abc import Callable
from math import prod

import numpy as np

from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.staging import PinnedPair


def fetch_later(ctx: driver.Context, landings: PinnedPair, tensors: list[DeviceTensor]
                ) -> Callable[[], list[np.ndarray]]:
    """Small contiguous tensors (a step's sampled tokens) copied into the next of the pinned `landings`, queued on
    the stream now; the call it returns waits for those copies alone (not for a step queued after them) and reads
    them, before the area is taken again two steps later. Tensors past the landing area are fetched one by one at
    once (the step waited for)."""
    sizes = [t.nbytes for t in tensors]
    landing = landings.take()
    if sum(sizes) + 256 * len(sizes) > landing.nbytes:  # read now, before a later step can overwrite them
        values = [fetch(ctx, t) for t in tensors]
        return lambda: values
    offsets = [sum(-(-n // 256) * 256 for n in sizes[:i]) for i in range(len(sizes))]
    for tensor, offset, nbytes in zip(tensors, offsets, sizes):
        assert tensor.dense, "fetch_later reads contiguous tensors"
        driver.copy_to_host(landing[offset: offset + nbytes], tensor.ptr, ctx.stream)
    landed = landings.queued(ctx.stream)

    def read() -> list[np.ndarray]:
        landed.synchronize()
        return [landing[o: o + n].view(t.dtype.np_dtype).reshape(t.shape).copy()
                for t, o, n in zip(tensors, offsets, sizes)]
    return read


def fetch(ctx: driver.Context, tensor: DeviceTensor) -> np.ndarray:
    """A tensor's values; a view of rows narrower than their stride (the logits a split cut from the gathered
    vocabulary's padding) read row span by row span and cut."""
    rows, width = (tensor.shape[0], prod(tensor.shape[1:])) if tensor.shape else (1, 1)
    span = (rows - 1) * tensor.row_stride + width if rows else 0
    host = np.empty(span, dtype=tensor.dtype.np_dtype)
    # the step first, without the GIL: a copy into pageable memory waits for the stream holding it
    ctx.synchronize()
    driver.copy_to_host(host, tensor.ptr, ctx.stream)
    ctx.synchronize()
    itemsize = host.itemsize
    rows_view = np.lib.stride_tricks.as_strided(host, (rows, width), (tensor.row_stride * itemsize, itemsize))
    return rows_view.reshape(tensor.shape).copy()
