"""`--quantization fp8`: a float checkpoint's projections quantized as they are loaded, a scale per output channel
(its row's largest magnitude to FP8_MAX), one tensor at a time: host memory holds the tensors in flight, never the
checkpoint quantized whole (64 GB of bf16 for a 32B model)."""

import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pegainfer.frontends.checkpoint import FileSpan
from pegainfer.frontends.quantization import FP8_MAX, ONLINE
from pegainfer.ir.dtypes import BF16, F8E4M3, DType
from pegainfer.ir.graph import Graph
from pegainfer.ir.types import TensorType

ROWS_PER_TASK = 256  # rows a thread quantizes at a time: 2.5 MB of float32 for a 2560-wide weight


def quantize_rows(weight: np.ndarray, workers: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 values, float32 scales [rows, 1]) of a float weight: each row divided by its largest magnitude / FP8_MAX
    and rounded to nearest even (a quotient past FP8_MAX by a rounding rounds back to it); an all-zero row's scale 1.
    Blocks of rows in `workers` threads (default: every core this process may use; NumPy lets go of the GIL), so
    that quantizing at load keeps up with the upload."""
    values = np.empty(weight.shape, F8E4M3.np_dtype)
    scale = np.empty((weight.shape[0], 1), np.float32)

    def quantize(start: int) -> None:
        block = widen(weight[start:start + ROWS_PER_TASK])  # a copy: divided in place below
        rows = slice(start, start + len(block))
        scale[rows] = np.abs(block).max(axis=1, keepdims=True) / np.float32(FP8_MAX)
        scale[rows][scale[rows] == 0] = 1
        np.divide(block, scale[rows], out=block)
        values[rows] = round_to_e4m3(block)
    with ThreadPoolExecutor(workers or len(os.sched_getaffinity(0))) as pool:
        list(pool.map(quantize, range(0, weight.shape[0], ROWS_PER_TASK)))
    return values, scale


def widen(block: np.ndarray) -> np.ndarray:
    """A float block as float32; bfloat16 by a shift of its bits (ml_dtypes' cast holds the GIL, 0.4 G values/s)."""
    if block.dtype != BF16.np_dtype:
        return block.astype(np.float32)
    return (block.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 values within +-FP8_MAX as e4m3fn, rounded to nearest even, in NumPy's own integer ops (which let go
    of the GIL, unlike ml_dtypes' cast): a normal keeps 3 of the 23 mantissa bits and rebiases 127 to 7; below
    2^-6 a value is a multiple of 2^-9 (8 of them rounding up to the smallest normal, whose code is 8)."""
    bits = x.view(np.uint32)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    kept = magnitude + np.uint32(0x7FFFF) + ((magnitude >> np.uint32(20)) & np.uint32(1))  # ties to even
    code = np.minimum((kept >> np.uint32(20)) - np.uint32((127 - 7) << 3), np.uint32(0x7E)).astype(np.uint8)
    small = magnitude < np.uint32(0x3C800000)  # below 2^-6: few in a weight scaled to FP8_MAX
    code[small] = np.rint(np.abs(x[small]) * np.float32(512)).astype(np.uint8)
    code |= (bits >> np.uint32(24)).astype(np.uint8) & np.uint8(0x80)
    return code.view(F8E4M3.np_dtype)


class QuantizedWeights(Mapping[str, np.ndarray]):
    """The graph's checkpoint params over `stored` (a float checkpoint's tensors, read lazily or not): a projection
    the graph reads as FP8 quantized when it or its `_scale` is first asked for, the other kept until taken."""

    def __init__(self, stored: Mapping[str, np.ndarray], graph: Graph) -> None:
        self.stored, self.expected = stored, graph.checkpoint_params()  # `expected`: each tensor's type, unread
        self.fp8 = {name for name, t in self.expected.items() if t.dtype == F8E4M3}
        self._pending: dict[str, np.ndarray] = {}  # the half of a pair not asked for yet
        self._lock = threading.Lock()  # the GPU uploader's readers ask from several threads

    def __getitem__(self, name: str) -> np.ndarray:
        weight = name.removesuffix(ONLINE.scale_suffix)
        if name not in self.expected:
            raise KeyError(name)
        if weight not in self.fp8:
            return self.stored[name]
        with self._lock:
            if name in self._pending:
                return self._pending.pop(name)
        values, scale = quantize_rows(self.stored[weight])
        with self._lock:
            other = weight + ONLINE.scale_suffix if name == weight else weight
            self._pending[other] = values if other == weight else scale
        return values if name == weight else scale

    def span(self, name: str) -> FileSpan | None:
        """Where an unquantized tensor's bytes lie in its file (LazyWeights.span); None for the quantized ones."""
        span = getattr(self.stored, "span", None)
        return None if span is None or name.removesuffix(ONLINE.scale_suffix) in self.fp8 else span(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.expected)

    def __len__(self) -> int:
        return len(self.expected)


def stored_params(graph: Graph, dtype: DType) -> dict[str, TensorType]:
    """What a checkpoint quantized at load holds of the tensors the graph reads: each one it reads as FP8 (a
    projection, a stacked expert's source, a regrouped weight's source) in `dtype`, and none of their scales."""
    needed = graph.checkpoint_params()
    fp8 = {name for name, t in needed.items() if t.dtype == F8E4M3}
    return {name: TensorType(dtype, t.shape) if name in fp8 else t for name, t in needed.items()
            if name in fp8 or name.removesuffix(ONLINE.scale_suffix) not in fp8}
