"""Normalisation ops."""

import numpy as np

from pegainfer.ir.registry import ROW_REDUCTION, expect, register_op
from pegainfer.ir.types import TensorType


def _infer_rms_norm(x: TensorType, weight: TensorType, *, eps: float, offset: float = 0.0) -> TensorType:
    expect(x.dtype.is_float, f"rms_norm: input must be float, found {x}")
    expect(weight.shape == (x.shape[-1],), f"rms_norm: weight must be [{x.shape[-1]}], found {weight}")
    expect(eps > 0, f"rms_norm: eps must be positive, found {eps}")
    return x


def _rms_norm(x: np.ndarray, weight: np.ndarray, *, eps: float, offset: float = 0.0) -> np.ndarray:
    """Normalises the last axis: x / sqrt(mean(x^2) + eps) * (weight + offset). Models that store norm weights
    around zero scale by 1 + weight: offset 1."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(variance + np.float32(eps)) * (weight + np.float32(offset) if offset else weight)


register_op("rms_norm", _infer_rms_norm, _rms_norm, ROW_REDUCTION)
