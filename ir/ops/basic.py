"""Embedding, linear layers, elementwise arithmetic and shape ops."""

import numpy as np

from pegainfer.ir.registry import expect, register_op
from pegainfer.ir.types import Dim, TensorType, same_elements


def _infer_embedding(ids: TensorType, table: TensorType) -> TensorType:
    expect(not ids.dtype.is_float, f"embedding: ids must be integers, found {ids}")
    expect(table.rank == 2, f"embedding: table must be [vocab, hidden], found {table}")
    return TensorType(table.dtype, (*ids.shape, table.shape[1]))


def _embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    return table[ids]


def _infer_linear(x: TensorType, w: TensorType, bias: TensorType | None = None) -> TensorType:
    expect(w.rank == 2, f"linear: weight must be [out, in], found {w}")
    expect(x.rank >= 1 and x.shape[-1] == w.shape[1],
           f"linear: input's last dim must equal weight's in-features {w.shape[1]}, found {x}")
    if bias is not None:
        expect(bias.shape == (w.shape[0],), f"linear: bias must be [{w.shape[0]}], found {bias}")
    return TensorType(x.dtype, (*x.shape[:-1], w.shape[0]))


def _linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    y = x @ w.T
    return y if bias is None else y + bias


def _infer_same(a: TensorType, b: TensorType) -> TensorType:
    expect(a == b, f"elementwise: operands must have the same type, found {a} and {b}")
    return a


def _infer_float(x: TensorType) -> TensorType:
    expect(x.dtype.is_float, f"activation: input must be a float tensor, found {x}")
    return x


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _infer_reshape(x: TensorType, *, shape: tuple[Dim, ...]) -> TensorType:
    expect(same_elements(x.shape, tuple(shape)), f"reshape: cannot reshape {x} to [{','.join(map(str, shape))}]")
    return x.with_shape(tuple(shape))


def _reshape(x: np.ndarray, *, shape: tuple[Dim, ...]) -> np.ndarray:
    # One symbolic dim is resolved by NumPy from the element count; the type rule already checked the rest.
    concrete = [d if isinstance(d, int) else -1 for d in shape]
    assert concrete.count(-1) <= 1, f"reshape to {shape}: more than one symbolic dim is not supported"
    return x.reshape(concrete)


def _infer_gather_rows(x: TensorType, index: TensorType) -> TensorType:
    expect(x.rank == 2, f"gather_rows: source must be [rows, cols], found {x}")
    expect(index.rank == 1 and not index.dtype.is_float, f"gather_rows: index must be 1-d integers, found {index}")
    return TensorType(x.dtype, (index.shape[0], x.shape[1]))


def _gather_rows(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    return x[index]


register_op("embedding", _infer_embedding, _embedding)
register_op("linear", _infer_linear, _linear, optional_inputs=1)
register_op("add", _infer_same, np.add)
register_op("mul", _infer_same, np.multiply)
register_op("silu", _infer_float, _silu)
register_op("reshape", _infer_reshape, _reshape)
register_op("gather_rows", _infer_gather_rows, _gather_rows)
