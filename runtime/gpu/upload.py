"""Weights to the GPU through a ring of pinned staging buffers: while the copy engine moves one chunk up, the host
fills the next, read straight from the safetensors file into pinned memory (no mmap page faults, no pageable
bounce). A chunk's buffer is reused only once the event recorded after its copy has fired."""

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import numpy as np

from pegainfer.frontends.checkpoint import FileSpan
from pegainfer.ir.graph import Graph
from pegainfer.progress import Progress
from pegainfer.runtime.cuda import driver

CHUNK_BYTES = 32 << 20
BUFFERS = 4


@dataclass
class StagingRing:
    stream: object
    buffers: list[np.ndarray] = field(default_factory=list)
    events: list[driver.Event | None] = field(default_factory=list)
    next: int = 0
    files: dict[Path, object] = field(default_factory=dict)

    @classmethod
    def create(cls, stream, buffers: int = BUFFERS, chunk: int = CHUNK_BYTES) -> "StagingRing":
        return cls(stream, [driver.alloc_pinned(chunk) for _ in range(buffers)], [None] * buffers)

    def _buffer(self) -> int:
        """The next staging buffer, once the copy that last read it is done."""
        index = self.next
        self.next = (self.next + 1) % len(self.buffers)
        if self.events[index] is not None:
            self.events[index].synchronize()
        self.events[index] = None
        return index

    def _send(self, index: int, dst: int, nbytes: int) -> None:
        driver.copy_to_device(dst, self.buffers[index][:nbytes], self.stream)
        event = driver.Event()
        event.record(self.stream)
        self.events[index] = event

    def put_array(self, dst: int, array: np.ndarray) -> None:
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        chunk = self.buffers[0].size
        for start in range(0, raw.size, chunk):
            piece = raw[start: start + chunk]
            index = self._buffer()
            self.buffers[index][: piece.size] = piece
            self._send(index, dst + start, piece.size)

    def put_span(self, dst: int, span: FileSpan) -> None:
        handle = self.files.get(span.file) or self.files.setdefault(span.file, open(span.file, "rb", buffering=0))
        chunk = self.buffers[0].size
        for start in range(0, span.nbytes, chunk):
            size = min(chunk, span.nbytes - start)
            index = self._buffer()
            handle.seek(span.offset + start)
            view = memoryview(self.buffers[index])[:size]
            got = 0
            while got < size:  # readinto may return short counts
                read = handle.readinto(view[got:])
                if not read:
                    raise OSError(f"{span.file}: ended at byte {span.offset + start + got}, expected {span.nbytes} "
                                  f"bytes from {span.offset}")
                got += read
            self._send(index, dst + start, size)

    def finish(self) -> None:
        for event in self.events:
            if event is not None:
                event.synchronize()
        for handle in self.files.values():
            handle.close()
        self.files.clear()


def upload_weights(graph: Graph, weights: Mapping[str, np.ndarray], stream, arena) -> dict[str, int]:
    """Every param of the graph (derived ones concatenated from their sources on the device) into `arena`.
    Sources that the mapping can give as file spans (LazyWeights.span) are read straight into pinned memory."""
    derivations = graph.derivations()
    params = graph.expanded_params()
    progress = Progress("loading weights", len(params))
    ring = StagingRing.create(stream)
    started, total, uploaded = time.perf_counter(), 0, {}
    span_of = getattr(weights, "span", lambda name: None)
    for name, t in params.items():
        ptr = arena.take(t.dtype.itemsize * prod(t.shape))
        offset = 0
        assert name not in derivations or derivations[name].axis == 0, f"{name}: only row concatenation"
        for source in derivations[name].sources if name in derivations else (name,):
            span = span_of(source)
            if span is not None:
                ring.put_span(ptr + offset, span)
                offset += span.nbytes
            else:
                array = weights[source]
                ring.put_array(ptr + offset, array)
                offset += array.nbytes
        assert offset == t.dtype.itemsize * prod(t.shape), f"{name}: uploaded {offset} bytes for {t}"
        uploaded[name] = ptr
        total += offset
        progress.advance()
    ring.finish()
    seconds = time.perf_counter() - started
    print(f"pegainfer: loaded {total / 1e9:.2f} GB of weights in {seconds:.1f} s "
          f"({total / 1e9 / max(seconds, 1e-9):.2f} GB/s)", file=sys.stderr)
    return uploaded


def params_bytes(graph: Graph) -> int:
    return sum(t.dtype.itemsize * prod(t.shape) for t in graph.expanded_params().values())
