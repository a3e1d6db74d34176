"""The `dequantize` op: a weight as an FP8 checkpoint stores it (float8 e4m3 values, a float32 scale per block of
rows x columns, the last blocks cut short by the weight's edge) to the values it stands for, in the model's dtype:
value * scale of its block, in float32, rounded once. Per-channel scales are blocks of one row and every column."""

import ml_dtypes
import numpy as np

from pegainfer.ir.dtypes import FP32, dtype_from_name
from pegainfer.ir.registry import DEQUANTIZE, expect, register_op
from pegainfer.ir.types import TensorType


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _infer_dequantize(q: TensorType, scale: TensorType, *, block: tuple[int, int], dtype: str) -> TensorType:
    expect(q.rank == 2 and q.dtype.name.startswith("f8"), f"dequantize: the stored weight must be FP8 [out, in], "
           f"found {q}")
    expect(len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
           f"dequantize: block must be two positive sizes, found {block}")
    expected = TensorType(FP32, scale_shape(q.shape, tuple(block)))
    expect(scale == expected, f"dequantize: the scales must be {expected} for blocks of {list(block)}, found {scale}")
    return TensorType(dtype_from_name(dtype), q.shape)


def dequantize(q: np.ndarray, scale: np.ndarray, *, block: tuple[int, int], dtype: str) -> np.ndarray:
    rows, cols = q.shape
    expanded = np.repeat(np.repeat(np.asarray(scale, np.float32), block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return (np.asarray(q).astype(np.float32) * expanded).astype(dtype_from_name(dtype).np_dtype)


register_op("dequantize", _infer_dequantize, dequantize, DEQUANTIZE)


E4M3_MAX = 448.0  # the largest finite float8 e4m3fn
ROW_GROUP = 128  # the columns of a row quantization group


def quantize_row_groups(x: np.ndarray, group: int = ROW_GROUP) -> tuple[np.ndarray, np.ndarray]:
    """A GEMM's rows as its W8A8 kernel multiplies them (backends/tilelang/kernels/rows.py `quantize_rows`, as
    vLLM's per-token-group quantization): each row's groups of `group` columns over their largest magnitude / 448
    (at least 1e-10 / 448), rounded to nearest e4m3. (values [M, K] e4m3, scales [M, K / group] float32); the rows
    stand for values * scale of their group."""
    rows, cols = x.shape
    if cols % group:
        raise ValueError(f"quantize_row_groups: {cols} columns are not whole groups of {group}")
    groups = np.asarray(x, np.float32).reshape(rows, cols // group, group)
    scales = np.maximum(np.abs(groups).max(axis=2), np.float32(1e-10)) / np.float32(E4M3_MAX)
    values = (groups / scales[:, :, None]).astype(ml_dtypes.float8_e4m3fn)
    return values.reshape(rows, cols), scales.astype(np.float32)
