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
        self.pitch = self._even_pitch()
        self.host = driver.alloc_pinned(capacity * self.per_block)
        self._timing: list[tuple[driver.Event, driver.Event]] = []  # restores queued, oldest first
        self._events: list[tuple[driver.Event, driver.Event]] = []  # pairs read, to record again
        self.seconds = 0.0

    def _even_pitch(self) -> int | None:
        """The bytes between consecutive states when all are one size at one stride (the usual KV arena: K and V of
        every layer alike), so that a block moves in one 2D copy; None otherwise (a copy per state)."""
        (first, size), rest = self.parts[0], self.parts[1:]
        pitch = rest[0][0] - first if rest else size
        even = all(s == size and p == first + i * pitch for i, (p, s) in enumerate(self.parts))
        return pitch if even and pitch >= size else None

    def offload(self, device_block: int, host_block: int) -> None:
        self._copy(device_block, host_block, to_host=True)

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs copied back, timed by events read once they have passed."""
        start, end = self._events.pop() if self._events else (driver.Event(), driver.Event())
        start.record(self.stream)
        for host_block, device_block in pairs:
            self._copy(device_block, host_block, to_host=False)
        end.record(self.stream)
        self._timing.append((start, end))

    def restore_seconds(self) -> float:
        """The copies back's time so far, of those finished (events reused once read)."""
        while self._timing and self._timing[0][1].done():
            start, end = self._timing.pop(0)
            self.seconds += end.seconds_since(start)
            self._events.append((start, end))
        return self.seconds

    def _copy(self, device_block: int, host_block: int, to_host: bool) -> None:
        start = host_block * self.per_block
        if self.pitch is not None:
            first, size = self.parts[0]
            driver.copy_rows(self.host[start:start + self.per_block], first + device_block * size, self.pitch,
                             len(self.parts), to_host, self.stream)
            return
        for offset, (ptr, size) in zip(start + np.cumsum([0] + [s for _, s in self.parts[:-1]]), self.parts):
            host, device = self.host[offset:offset + size], ptr + device_block * size
            if to_host:
                driver.copy_to_host(host, device, self.stream)
            else:
                driver.copy_to_device(device, host, self.stream)
