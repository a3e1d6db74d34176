"""Embedding, linear layers, elementwise arithmetic and shape ops."""

import numpy as np

from pegainfer.ir.registry import ELEMENTWISE, GATHER, GEMM, ROW_REDUCTION, VIEW, expect, register_op
from pegainfer.ir.dtypes import FP32, INT32, dtype_from_name
from pegainfer.ir.types import Dim, TensorType, same_elements


def _infer_embedding(ids: TensorType, table: TensorType, *, scale: float = 1.0,
                     first_id: int | None = None) -> TensorType:
    expect(not ids.dtype.is_float, f"embedding: ids must be integers, found {ids}")
    expect(table.rank == 2, f"embedding: table must be [vocab, hidden], found {table}")
    expect(scale > 0, f"embedding: scale must be positive, found {scale}")
    expect(first_id is None or (isinstance(first_id, int) and first_id >= 0),
           f"embedding: first_id must be a non-negative int or absent, found {first_id!r}")
    return TensorType(table.dtype, (*ids.shape, table.shape[1]))


def _embedding(ids: np.ndarray, table: np.ndarray, *, scale: float = 1.0, first_id: int | None = None) -> np.ndarray:
    """Rows of the table, times `scale` (some models scale their embeddings by sqrt(hidden)). With `first_id`
    the table is one rank's part of the vocabulary, ids first_id .. first_id + rows - 1. Ids outside the table give
    zeros (a negative one is never a row counted from the end)."""
    local = np.asarray(ids) - (first_id or 0)
    held = (local >= 0) & (local < len(table))
    rows = table[np.where(held, local, 0)]
    if not held.all():
        rows = np.where(held[..., None], rows, np.zeros((), rows.dtype))
    return rows if scale == 1.0 else rows * np.float32(scale)


def _infer_linear(x: TensorType, w: TensorType, bias: TensorType | None = None, *,
                  dtype: str | None = None) -> TensorType:
    """dtype: the output's, where it differs from the input's (a router's float32 logits)."""
    expect(w.rank == 2, f"linear: weight must be [out, in], found {w}")
    expect(x.rank >= 1 and x.shape[-1] == w.shape[1],
           f"linear: input's last dim must equal weight's in-features {w.shape[1]}, found {x}")
    if bias is not None:
        expect(bias.shape == (w.shape[0],), f"linear: bias must be [{w.shape[0]}], found {bias}")
    out = x.dtype if dtype is None else dtype_from_name(dtype)
    expect(out.is_float, f"linear: the output dtype must be a float type, found {dtype!r}")
    return TensorType(out, (*x.shape[:-1], w.shape[0]))


def _linear(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, *, dtype: str | None = None) -> np.ndarray:
    y = x @ w.T
    return y if bias is None else y + bias


def _infer_same(a: TensorType, b: TensorType) -> TensorType:
    expect(a == b, f"elementwise: operands must have the same type, found {a} and {b}")
    return a


def _infer_scale_rows(x: TensorType, scale: TensorType) -> TensorType:
    expect(scale.dtype == x.dtype and scale.shape == (*x.shape[:-1], 1),
           f"scale_rows: the scale must be {x.with_shape((*x.shape[:-1], 1))}, one value a row of {x}, found {scale}")
    return x


def _scale_rows(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Each row times its own scalar (a gate of one column, as a gated shared expert has)."""
    return x * scale


def _infer_float(x: TensorType) -> TensorType:
    expect(x.dtype.is_float, f"activation: input must be a float tensor, found {x}")
    return x


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


SOFTPLUS_LINEAR_ABOVE = 20.0  # torch's softplus threshold: above it softplus(x) is x


def _infer_decay_gate(a: TensorType, a_log: TensorType, dt_bias: TensorType) -> TensorType:
    expect(a.dtype.is_float and a.rank >= 1, f"decay_gate: a must be float [..., heads], found {a}")
    for name, t in (("a_log", a_log), ("dt_bias", dt_bias)):
        expect(t.shape == (a.shape[-1],), f"decay_gate: {name} must be [{a.shape[-1]}], found {t}")
    return TensorType(FP32, a.shape)


def _decay_gate(a: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray) -> np.ndarray:
    """A linear-attention layer's log decay per head, -exp(a_log) * softplus(a + dt_bias), kept in float32: its
    exponent multiplies the state at every token, so a bf16 rounding here would compound."""
    x = a + dt_bias
    softplus = np.where(x > SOFTPLUS_LINEAR_ABOVE, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_LINEAR_ABOVE))))
    return -np.exp(a_log) * softplus


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (Hugging Face's gelu_pytorch_tanh)."""
    inner = np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(inner))


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


def _infer_split(x: TensorType, *, sizes: tuple[int, ...]) -> tuple[TensorType, ...]:
    expect(x.rank >= 1 and x.shape[-1] == sum(sizes), f"split: sizes {list(sizes)} must add up to the last dim "
                                                      f"of {x}")
    return tuple(x.with_shape((*x.shape[:-1], size)) for size in sizes)


def _split(x: np.ndarray, *, sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=-1))


def _infer_concat(*xs: TensorType) -> TensorType:
    expect(len(xs) >= 2, f"concat: joins at least two values, found {len(xs)}")
    first = xs[0]
    expect(all(x.dtype == first.dtype and x.shape[:-1] == first.shape[:-1] and isinstance(x.shape[-1], int)
               for x in xs), f"concat: values must share a dtype and every dim but a fixed last one, found "
                             f"{[str(x) for x in xs]}")
    return first.with_shape((*first.shape[:-1], sum(x.shape[-1] for x in xs)))


def _concat(*xs: np.ndarray) -> np.ndarray:
    """The values side by side along the last dim (a drafter's embedding beside the target's hidden state)."""
    return np.concatenate(xs, axis=-1)


def _zeros_like(x: np.ndarray) -> np.ndarray:
    return np.zeros_like(x)


def _infer_top_k(x: TensorType, wanted: TensorType | None = None, *, k: int) -> tuple[TensorType, TensorType]:
    expect(x.rank == 2 and isinstance(x.shape[1], int) and 0 < k <= x.shape[1],
           f"top_k: input must be [rows, n] with 0 < k <= n, found {x} and k={k}")
    expect(wanted is None or (wanted.dtype == INT32 and wanted.shape == (x.shape[0],)),
           f"top_k: `wanted` must be int32 [{x.shape[0]}], found {wanted}")
    return TensorType(FP32, (x.shape[0], k)), TensorType(INT32, (x.shape[0], k))


def _top_k(x: np.ndarray, wanted: np.ndarray | None = None, *, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest values of each row in descending order, ties broken by the lower index. Where `wanted` is 0 a
    row keeps only its largest (the others -inf, ids -1): ranking the rest is what costs."""
    order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    values, ids = np.take_along_axis(x, order, axis=-1).astype(np.float32), order.astype(np.int32)
    if wanted is not None:
        unranked = np.asarray(wanted) == 0
        values[unranked, 1:], ids[unranked, 1:] = -np.inf, -1
    return values, ids


def _infer_logsumexp(x: TensorType) -> TensorType:
    expect(x.rank == 2 and x.dtype.is_float, f"logsumexp: input must be float [rows, n], found {x}")
    return TensorType(FP32, (x.shape[0],))


def _logsumexp(x: np.ndarray) -> np.ndarray:
    peak = x.max(axis=-1)
    return peak + np.log(np.exp(x - peak[:, None]).sum(axis=-1))


register_op("embedding", _infer_embedding, _embedding, GATHER)
register_op("linear", _infer_linear, _linear, GEMM)
register_op("add", _infer_same, np.add, ELEMENTWISE)
register_op("mul", _infer_same, np.multiply, ELEMENTWISE)
register_op("scale_rows", _infer_scale_rows, _scale_rows, ELEMENTWISE)
register_op("silu", _infer_float, _silu, ELEMENTWISE)
register_op("gelu_tanh", _infer_float, _gelu_tanh, ELEMENTWISE)
register_op("sigmoid", _infer_float, _sigmoid, ELEMENTWISE)
register_op("decay_gate", _infer_decay_gate, _decay_gate, ELEMENTWISE)
register_op("zeros_like", _infer_float, _zeros_like, ELEMENTWISE)
register_op("reshape", _infer_reshape, _reshape, VIEW)
register_op("split", _infer_split, _split, VIEW)
register_op("concat", _infer_concat, _concat, GATHER)
register_op("gather_rows", _infer_gather_rows, _gather_rows, GATHER)
register_op("top_k", _infer_top_k, _top_k, ROW_REDUCTION)
register_op("logsumexp", _infer_logsumexp, _logsumexp, ROW_REDUCTION)
