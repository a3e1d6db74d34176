"""The GPU engine's side of the host KV tier (runtime/host_tier.py): a pool of pinned host blocks in the device KV
cache's layout (every paged state's bytes of one block, back to back). Copies both ways are queued on the step
stream: a copy down then reads its block before any later step can reuse it, a copy back lands before the step that
reads it, and the host never waits (it never reads the pinned pool itself)."""

from math import prod

import numpy as np

from pegainfer.runtime.cuda import driver


class HostBlocks:
    def __init__(self, stream, paged: dict[str, object], capacity: int) -> None:
        """`paged`: the KV cache's states (DeviceTensors of [num_blocks, ...]); `capacity`: host blocks."""
        self.stream = stream
        self.parts = [(t.ptr, prod(t.shape[1:]) * t.dtype.itemsize) for t in paged.values()]
        self.per_block = sum(size for _, size in self.parts)
        self.host = driver.alloc_pinned(capacity * self.per_block)

    def offload(self, device_block: int, host_block: int) -> None:
        for offset, (ptr, size) in self._spans(host_block):
            driver.copy_to_host(self.host[offset:offset + size], ptr + device_block * size, self.stream)

    def restore(self, host_block: int, device_block: int) -> None:
        for offset, (ptr, size) in self._spans(host_block):
            driver.copy_to_device(ptr + device_block * size, self.host[offset:offset + size], self.stream)

    def _spans(self, host_block: int) -> list[tuple[int, tuple[int, int]]]:
        offsets = host_block * self.per_block + np.cumsum([0] + [size for _, size in self.parts[:-1]])
        return list(zip(offsets.tolist(), self.parts))
