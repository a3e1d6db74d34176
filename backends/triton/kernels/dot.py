"""The tensor-core product the attention and expert templates share (gemm.py keeps its own `dot`)."""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b; UPCAST (only under Triton's CPU interpreter, whose bf16 dot is wrong in Triton 3.6) in float32."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc
