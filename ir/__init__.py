"""The IR: dtypes, tensor types with symbolic dims, graphs of ops, the op registry with reference semantics."""

from pegainfer.ir.dtypes import BF16, FP16, FP32, INT32, INT64, DType, dtype_from_name
from pegainfer.ir.types import Dim, TensorType
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.builder import GraphBuilder, Value
from pegainfer.ir import ops as _ops  # noqa: F401  registers the built-in ops

__all__ = [
    "BF16", "FP16", "FP32", "INT32", "INT64", "DType", "dtype_from_name",
    "Dim", "TensorType", "Graph", "Node", "GraphBuilder", "Value",
]
