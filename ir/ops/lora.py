"""LoRA: the low-rank update of a projection for the rows of several adapters at once (each request picks its
own). Every loaded adapter holds a slot of the stacked tables: its A padded to the tables' rank with zero rows, its
B with zero columns, so padding adds nothing, and its scale (alpha / rank, or alpha / sqrt(rank) for rsLoRA). A
row takes scale[s] * B[s] (A[s] x) for its slot s; a row of slot -1 (the base model) takes nothing. `lora_add`
adds that update to the base projection's output in place (passes/lora.py forms it), so a step whose rows have
no adapter may skip it and read the base output as it is."""

import numpy as np

from pegainfer.ir.registry import GEMM, expect, register_op
from pegainfer.ir.types import TensorType


def _infer_lora(x: TensorType, a: TensorType, b: TensorType, scale: TensorType, slots: TensorType) -> TensorType:
    expect(x.rank == 2 and x.dtype.is_float, f"lora: input must be float [tokens, in], found {x}")
    expect(a.rank == 3 and a.shape[2] == x.shape[1], f"lora: A must be [slots, rank, {x.shape[1]}], found {a}")
    expect(b.rank == 3 and b.shape[0] == a.shape[0] and b.shape[2] == a.shape[1],
           f"lora: B must be [{a.shape[0]}, out, {a.shape[1]}], found {b}")
    expect(scale.rank == 1 and scale.shape[0] == a.shape[0] and scale.dtype.is_float,
           f"lora: scale must be float [{a.shape[0]}], found {scale}")
    expect(slots.shape == (x.shape[0],) and not slots.dtype.is_float,
           f"lora: slots must be integers [{x.shape[0]}], found {slots}")
    return TensorType(x.dtype, (x.shape[0], b.shape[1]))


def _lora(x: np.ndarray, a: np.ndarray, b: np.ndarray, scale: np.ndarray, slots: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    out = np.zeros((len(x), b.shape[1]), np.float32)
    for slot in np.unique(slots[slots >= 0]):
        rows = slots == slot
        out[rows] = np.float32(scale[slot]) * ((x[rows] @ a[slot].astype(np.float32).T) @ b[slot].astype(np.float32).T)
    return out


def _infer_lora_add(base: TensorType, x: TensorType, a: TensorType, b: TensorType, scale: TensorType,
                    slots: TensorType, norm: TensorType | None = None, *, eps: float | None = None) -> TensorType:
    update = _infer_lora(x, a, b, scale, slots)
    expect(base == update, f"lora_add: base must be {update}, found {base}")
    expect((norm is None) == (eps is None), "lora_add: a norm weight comes with eps, and eps with a norm weight")
    expect(norm is None or norm.shape == (x.shape[1],), f"lora_add: norm weight must be [{x.shape[1]}], found {norm}")
    return base


def _lora_add(base: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, scale: np.ndarray, slots: np.ndarray,
              norm: np.ndarray | None = None, *, eps: float | None = None) -> np.ndarray:
    """base + the update of x, or with `norm`, of RMSNorm(x) by that weight (in float32: the GEMM beside it takes
    the norm in its prologue, so x normed is never stored)."""
    if norm is not None:
        x = np.asarray(x, np.float32)
        x = x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps)) * norm
    return np.asarray(base, np.float32) + _lora(x, a, b, scale, slots)


register_op("lora", _infer_lora, _lora, GEMM)
register_op("lora_add", _infer_lora_add, _lora_add, GEMM, mutates=(0,))
