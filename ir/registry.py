"""The op registry: every op declares its shape/dtype rule and its NumPy reference implementation.

Reference implementations take float32 arrays for float values (int arrays for indices), except inputs that are
states (the KV cache), which arrive in their storage dtype so that writes land in place. They return float32;
the interpreter rounds each result to the dtype its type declares, as the GPU's storage would.
"""

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pegainfer.errors import GraphError
from pegainfer.ir.types import TensorType

InferRule = Callable[..., TensorType | tuple[TensorType, ...]]
Reference = Callable[..., np.ndarray | tuple[np.ndarray, ...]]


# What the fusion passes need to know of an op, whatever its name.
ELEMENTWISE = "elementwise"  # each output row depends on the same row of the inputs alone, with no reduction
ROW_REDUCTION = "row_reduction"  # reads whole rows (the last axis): a norm, a softmax statistic, a top-k
VIEW = "view"  # a reshape or slice: no data moves on a GPU, so never a kernel of its own
GEMM = "gemm"
GATHER = "gather"
ATTENTION = "attention"
CACHE_WRITE = "cache_write"
DEQUANTIZE = "dequantize"  # a weight's stored form (FP8 and its scales) to its values: its GEMM's to read
RECURRENCE = "recurrence"  # a scan over each sequence's tokens in order, carrying a state per sequence
COLLECTIVE = "collective"  # data exchanged between the ranks of a sharded graph (NCCL's, never a kernel of ours)
CATEGORIES = (ELEMENTWISE, ROW_REDUCTION, VIEW, GEMM, GATHER, ATTENTION, CACHE_WRITE, DEQUANTIZE, RECURRENCE,
              COLLECTIVE)


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: InferRule
    reference: Reference
    category: str
    mutates: tuple[int, ...] = ()  # input positions written in place; the op returns them first, in that order


OPS: dict[str, OpDef] = {}


def register_op(name: str, infer: InferRule, reference: Reference, category: str, *,
                mutates: tuple[int, ...] = ()) -> OpDef:
    assert name not in OPS, f"op {name!r} registered twice"
    assert category in CATEGORIES, f"op {name!r}: unknown category {category!r}"
    OPS[name] = OpDef(name, infer, reference, category, mutates)
    return OPS[name]


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise GraphError(f"unknown op {name!r}; registered ops: {', '.join(sorted(OPS))}") from None


def infer_types(op: str, input_types: list[TensorType], attrs: dict[str, Any]) -> tuple[TensorType, ...]:
    result = get_op(op).infer(*input_types, **attrs)
    return result if isinstance(result, tuple) else (result,)


def expect(condition: bool, message: str) -> None:
    """A type rule's check: raises GraphError with what was expected and found."""
    if not condition:
        raise GraphError(message)
