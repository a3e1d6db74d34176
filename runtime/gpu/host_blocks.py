"""The GPU engine's side of the host KV tier (runtime/host_tier.py): a pool of pinned host blocks in the device KV
cache's layout (every paged state's bytes of one block, back to back). Copies down run on one side stream and copies
back on another, each after the steps queued so far (which wrote or last read the device block), so they overlap
the steps that follow, and a restore does not queue behind the copies down in flight; the two wait for each other
only where they share a block (a host block written and then read back, or read and then written over; a device
block read and then written). The step stream waits for a copy only before the step after its device block is
evicted (settle): a restored block is read only once the host has seen its copies land (`restore_done`; the
scheduler admits the sequence then). The host never waits."""

import itertools
from collections import deque
from math import prod

import numpy as np

from pegainfer.runtime.cuda import driver


class HostBlocks:
    def __init__(self, stream, paged: dict[str, object], capacity: int) -> None:
        """`paged`: the KV cache's states (DeviceTensors of [num_blocks, ...]); `capacity`: host blocks."""
        self.stream, self.down, self.up = stream, driver.new_stream(), driver.new_stream()
        self.parts = [(t.ptr, prod(t.shape[1:]) * t.dtype.itemsize) for t in paged.values()]
        self.per_block = sum(size for _, size in self.parts)
        self.pitch = self._even_pitch()
        self.host = driver.alloc_pinned(capacity * self.per_block)
        self._after_steps = driver.Event(timing=False)  # recorded on the step stream before each copy
        self._down: deque[tuple[driver.Event, int, int]] = deque()  # copies down in flight, in stream order
        self._device_copy: dict[int, driver.Event] = {}  # a device block's copy down in flight
        self._host_written: dict[int, driver.Event] = {}  # a host block's copy down in flight
        self._spare: list[driver.Event] = []
        self._restores: dict[int, tuple[driver.Event, driver.Event]] = {}  # in flight by ticket, oldest first
        self._tickets = itertools.count()
        self._timers: list[tuple[driver.Event, driver.Event]] = []  # pairs read, to record again
        self._landing: dict[int, driver.Event] = {}  # a device block's copy back in flight
        self._host_read: dict[int, driver.Event] = {}  # a host block's copy back in flight
        self.seconds = 0.0

    def _even_pitch(self) -> int | None:
        """The bytes between consecutive states when all are one size at one stride (the usual KV arena: K and V of
        every layer alike), so that a block moves in one 2D copy; None otherwise (a copy per state)."""
        (first, size), rest = self.parts[0], self.parts[1:]
        pitch = rest[0][0] - first if rest else size
        even = all(s == size and p == first + i * pitch for i, (p, s) in enumerate(self.parts))
        return pitch if even and pitch >= size else None

    def offload(self, device_block: int, host_block: int) -> None:
        """The block copied down on the down stream, once the steps queued so far (its writes among them) are done,
        and any copy back that reads its host block or writes its device block."""
        self._reap()
        self._after_steps.record(self.stream)
        self._after_steps.wait(self.down)
        for pending in {id(e): e for e in (self._host_read.get(host_block), self._landing.get(device_block))
                        if e is not None}.values():
            pending.wait(self.down)
        self._copy(device_block, host_block, to_host=True, stream=self.down)
        done = self._spare.pop() if self._spare else driver.Event(timing=False)
        done.record(self.down)
        self._down.append((done, device_block, host_block))
        self._device_copy[device_block] = self._host_written[host_block] = done

    def settle(self, device_block: int) -> None:
        """The block leaves the device cache (evicted, to be written again): later steps wait for its copies."""
        for pending in (self._device_copy, self._landing):
            done = pending.pop(device_block, None)
            if done is not None:
                done.wait(self.stream)

    def restore(self, pairs: list[tuple[int, int]]) -> int:
        """(host block, device block) pairs copied back on the up stream, after the steps queued so far and the
        copies down that write those host blocks or read those device blocks; returns a ticket for `landed`. Timed
        by events, reused once read."""
        self._after_steps.record(self.stream)
        self._after_steps.wait(self.up)
        waits = [self._host_written.get(h) for h, _ in pairs] + [self._device_copy.get(d) for _, d in pairs]
        for pending in {id(e): e for e in waits if e is not None}.values():
            pending.wait(self.up)
        start, end = self._timers.pop() if self._timers else (driver.Event(), driver.Event())
        start.record(self.up)
        for host_block, device_block in pairs:
            self._copy(device_block, host_block, to_host=False, stream=self.up)
        end.record(self.up)
        self._restores[ticket := next(self._tickets)] = start, end
        self._landing |= dict.fromkeys((device for _, device in pairs), end)
        self._host_read |= dict.fromkeys((host for host, _ in pairs), end)
        return ticket

    def landed(self, ticket: int) -> bool:
        timers = self._restores.get(ticket)
        return timers is None or timers[1].done()

    def restore_seconds(self) -> float:
        """The copies back's time so far, of those finished (their tickets forgotten: landed)."""
        for ticket, (start, end) in list(self._restores.items()):
            if not end.done():
                break
            del self._restores[ticket]
            self.seconds += end.seconds_since(start)
            self._landing = {block: e for block, e in self._landing.items() if e is not end}
            self._host_read = {block: e for block, e in self._host_read.items() if e is not end}
            self._timers.append((start, end))
        return self.seconds

    def _reap(self) -> None:
        """Copies down that have finished: nothing waits for them any more, their events are reused."""
        while self._down and self._down[0][0].done():
            done, device_block, host_block = self._down.popleft()
            for pending, block in ((self._device_copy, device_block), (self._host_written, host_block)):
                if pending.get(block) is done:
                    del pending[block]
            self._spare.append(done)

    def _copy(self, device_block: int, host_block: int, to_host: bool, stream) -> None:
        start = host_block * self.per_block
        if self.pitch is not None:
            first, size = self.parts[0]
            driver.copy_rows(self.host[start:start + self.per_block], first + device_block * size, self.pitch,
                             len(self.parts), to_host, stream)
            return
        for offset, (ptr, size) in zip(start + np.cumsum([0] + [s for _, s in self.parts[:-1]]), self.parts):
            host, device = self.host[offset:offset + size], ptr + device_block * size
            if to_host:
                driver.copy_to_host(host, device, stream)
            else:
                driver.copy_to_device(device, host, stream)
