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


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: InferRule
    reference: Reference
    mutates: tuple[int, ...] = ()  # input positions written in place; the op returns them as outputs
    optional_inputs: int = 0  # how many trailing inputs may be left out (a bias, say)


OPS: dict[str, OpDef] = {}


def register_op(name: str, infer: InferRule, reference: Reference, *, mutates: tuple[int, ...] = (),
                optional_inputs: int = 0) -> OpDef:
    assert name not in OPS, f"op {name!r} registered twice"
    OPS[name] = OpDef(name, infer, reference, mutates, optional_inputs)
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
