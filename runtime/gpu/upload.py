"""Weights to the GPU through a ring of pinned staging buffers. Reader threads fill the buffers straight from the
safetensors files (pread into pinned memory: no mmap page faults, no pageable bounce, the GIL released) while the
copy engine moves earlier buffers up, so the load runs at the pace of several readers instead of one. A buffer is
refilled only once the event recorded after its copy has fired."""

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from math import prod

import numpy as np

from pegainfer.frontends.checkpoint import FileSpan, derive
from pegainfer.ir.graph import Derivation, Graph
from pegainfer.progress import Progress
from pegainfer.runtime.cuda import driver

CHUNK_BYTES = 16 << 20
BUFFERS = 8  # chunks in flight: filling, or being copied up
READERS = 4  # one thread copies ~5 GB/s out of the page cache on the H200's host; the PCIe link takes far more


class ArraySource:
    """A tensor that is no file span (it needs a cast): loaded when its first piece is filled and dropped after its
    last, so that host memory holds the few tensors in flight, never the checkpoint."""

    def __init__(self, load: Callable[[], np.ndarray], pieces: int) -> None:
        self._load, self._left, self._lock, self._bytes = load, pieces, threading.Lock(), None

    def take(self, start: int, nbytes: int) -> np.ndarray:
        with self._lock:  # pieces of one tensor may be filled by several readers at once
            if self._bytes is None:
                self._bytes = np.ascontiguousarray(self._load()).reshape(-1).view(np.uint8)
            piece = self._bytes[start: start + nbytes]
            self._left -= 1
            if self._left == 0:
                self._bytes = None
            return piece


@dataclass(frozen=True)
class Piece:
    """Bytes bound for `dst` on the device: a slice of a file span, or bytes start.. of an ArraySource."""
    dst: int
    nbytes: int
    span: FileSpan | None = None  # its offset is this piece's own
    source: ArraySource | None = None
    start: int = 0


def plan_pieces(graph: Graph, weights: Mapping[str, np.ndarray], take: Callable[[int], int],
                chunk: int = CHUNK_BYTES, skip: Collection[str] = ()) -> tuple[list[Piece], dict[str, int], list[str]]:
    """(the pieces of every param but those in `skip`, derived ones concatenated from their sources; each param's
    device address; the param that each piece completes, or "" for the rest: for the progress bar)."""
    derivations = graph.derivations()
    span_of = getattr(weights, "span", lambda name: None)
    pieces, addresses, completes = [], {}, []
    for name, t in graph.expanded_params().items():
        if name in skip:
            continue
        nbytes = t.dtype.itemsize * prod(t.shape)
        ptr = addresses[name] = take(nbytes)
        derivation = derivations.get(name)
        arrays = {}
        if derivation is not None and derivation.dequantize is not None:  # made on the host, then sent whole
            segments = [(name, 0, nbytes)]
            arrays[name] = ArraySource(lambda d=derivation: derive(d, weights), len(range(0, nbytes, chunk)))
        else:
            segments = _segments(derivation, weights) if derivation else [(name, 0, _stored_nbytes(weights, name))]
        for source in dict.fromkeys(source for source, _, _ in segments):
            if source not in arrays and span_of(source) is None:
                count = sum(len(range(a, b, chunk)) for s, a, b in segments if s == source)
                arrays[source] = ArraySource(lambda source=source: weights[source], count)
        offset = 0
        for source, begin, end in segments:
            span = None if source in arrays else span_of(source)
            for start in range(begin, end, chunk):
                n = min(chunk, end - start)
                pieces.append(Piece(ptr + offset + start - begin, n, start=start, source=arrays.get(source),
                                    span=FileSpan(span.file, span.offset + start, n) if span is not None else None))
                completes.append("")
            offset += end - begin
        assert offset == nbytes, f"{name}: planned {offset} bytes for {t}"
        completes[-1] = name
    return pieces, addresses, completes


def _segments(derivation: Derivation, weights: Mapping[str, np.ndarray]) -> list[tuple[str, int, int]]:
    """A derived param's pieces as (source, first byte, byte after the last) of the source as the graph stores it."""
    segments = []
    for source, start, stop in derivation.pieces():
        row = _stored_nbytes(weights, source) // derivation.source_types[derivation.sources.index(source)].shape[0]
        segments.append((source, start * row, stop * row))
    return segments


def _stored_nbytes(weights: Mapping[str, np.ndarray], name: str) -> int:
    """The tensor's size as the graph stores it, without loading it when the mapping knows its type."""
    expected = getattr(weights, "expected", None)
    if expected is not None:
        return expected[name].dtype.itemsize * prod(expected[name].shape)
    return weights[name].nbytes


def fill(piece: Piece, buffer: np.ndarray, files: dict) -> None:
    """Puts the piece's bytes at the start of `buffer` (runs in a reader thread)."""
    if piece.source is not None:
        buffer[: piece.nbytes] = piece.source.take(piece.start, piece.nbytes)
        return
    view, got = memoryview(buffer)[: piece.nbytes], 0
    while got < piece.nbytes:  # pread may return short counts
        read = os.preadv(files[piece.span.file], [view[got:]], piece.span.offset + got)
        if not read:
            raise OSError(f"{piece.span.file}: ended at byte {piece.span.offset + got}, expected {piece.nbytes} "
                          f"bytes from {piece.span.offset}")
        got += read


def stream_pieces(pieces: list[Piece], buffers: list[np.ndarray], send: Callable[[int, Piece], None],
                  wait_free: Callable[[int], None], readers: int = READERS,
                  sent: Callable[[int], None] = lambda index: None) -> None:
    """Fills buffers ahead in reader threads and sends them in order: `send(b, piece)` starts the copy of buffer b,
    `wait_free(b)` returns once buffer b's last copy is done, `sent(i)` follows piece i's send."""
    files = {path: os.open(path, os.O_RDONLY) for path in {p.span.file for p in pieces if p.span is not None}}
    pending: deque = deque()
    try:
        with ThreadPoolExecutor(readers, thread_name_prefix="pegainfer-weights") as pool:
            def send_oldest() -> None:
                index, future, b = pending.popleft()
                future.result()
                send(b, pieces[index])
                sent(index)
            for index, piece in enumerate(pieces):
                b = index % len(buffers)
                if len(pending) == len(buffers):
                    send_oldest()  # it holds buffer b
                wait_free(b)
                pending.append((index, pool.submit(fill, piece, buffers[b], files), b))
            while pending:
                send_oldest()
    finally:
        for fd in files.values():
            os.close(fd)


def upload_weights(graph: Graph, weights: Mapping[str, np.ndarray], stream, arena,
                   skip: Collection[str] = ()) -> dict[str, int]:
    """Every param of the graph but those in `skip` into `arena`; returns each one's device address. Sources that
    the mapping can give as file spans (LazyWeights.span) are read straight into pinned memory."""
    started = time.perf_counter()
    pieces, addresses, completes = plan_pieces(graph, weights, arena.take, skip=skip)
    buffers = [driver.alloc_pinned(CHUNK_BYTES) for _ in range(BUFFERS)]
    events: list = [None] * len(buffers)
    progress = Progress("loading weights", len(addresses))

    def send(b: int, piece: Piece) -> None:
        driver.copy_to_device(piece.dst, buffers[b][: piece.nbytes], stream)
        events[b] = driver.Event()
        events[b].record(stream)

    def wait_free(b: int) -> None:
        if events[b] is not None:
            events[b].synchronize()
            events[b] = None
    stream_pieces(pieces, buffers, send, wait_free, sent=lambda i: completes[i] and progress.advance())
    for b in range(len(buffers)):
        wait_free(b)
    for buffer in buffers:  # 128 MB of page-locked memory the process no longer needs
        driver.free_pinned(buffer)
    seconds = time.perf_counter() - started
    total = sum(p.nbytes for p in pieces)
    print(f"pegainfer: loaded {total / 1e9:.2f} GB of weights in {seconds:.1f} s "
          f"({total / 1e9 / max(seconds, 1e-9):.2f} GB/s)", file=sys.stderr)
    return addresses


def params_bytes(graph: Graph, skip: Collection[str] = ()) -> int:
    return sum(t.dtype.itemsize * prod(t.shape) for name, t in graph.expanded_params().items() if name not in skip)


def shared_params(graph: Graph, other: Graph) -> set[str]:
    """The params of `graph` that `other` holds alike on the device: the same name, type and derivation (a draft
    head reads its target's embedding and LM head)."""
    mine, theirs = graph.expanded_params(), other.expanded_params()
    derived, their_derived = graph.derivations(), other.derivations()
    return {name for name, t in mine.items()
            if theirs.get(name) == t and derived.get(name) == their_derived.get(name)}


def borrowed_params(graph: Graph, lenders: Sequence[tuple[Any, Collection[str] | None]]) -> dict[str, int]:
    """The device addresses of the params of `graph` (lowered) that the lenders (executors, each with the names
    it may lend, None: any) hold alike, the first one's."""
    borrowed: dict[str, int] = {}
    for lender, names in lenders:
        for name in shared_params(graph, lender.graph) - set(borrowed):
            if names is None or name in names:
                borrowed[name] = lender.weights[name]
    return borrowed
