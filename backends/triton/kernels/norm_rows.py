"""The [add +] RMSNorm of a decode GEMM's rows as a launch of its own (kernels/gemm.py's 16-row tiles and the LM
head's 64-row tiles read its float32 rows), so that each of the GEMM's programs does not repeat it."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def add_rms_norm_kernel(x_ptr, x2_ptr, rows_ptr, norm_ptr, sum_ptr, out_ptr, stride_x, stride_x2, stride_sum,
                        stride_out, K: tl.constexpr, EPS: tl.constexpr, ADD: tl.constexpr, GATHER: tl.constexpr,
                        WRITE_SUM: tl.constexpr, NORM_OFFSET: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    """A decode GEMM's prologue as its own launch, one program a row, so that the GEMM's programs do not each
    repeat it: the residual sum (written when WRITE_SUM) and its RMSNorm times the weight (+ NORM_OFFSET), in
    out_ptr's type (float32: the GEMM rounds it to its operand type, as its fused prologue does)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    m = tl.program_id(0)
    row = tl.load(rows_ptr + m) if GATHER else m
    offs_k = tl.arange(0, BLOCK_K)
    mask = offs_k < K
    a = tl.load(x_ptr + row * stride_x + offs_k, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        a += tl.load(x2_ptr + row * stride_x2 + offs_k, mask=mask, other=0.0).to(tl.float32)
    if WRITE_SUM:
        tl.store(sum_ptr + m * stride_sum + offs_k, a.to(sum_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(a * a, axis=0) / K + EPS)
    weight = tl.load(norm_ptr + offs_k, mask=mask, other=0.0).to(tl.float32) + NORM_OFFSET
    tl.store(out_ptr + m * stride_out + offs_k, (a * rstd * weight).to(out_ptr.dtype.element_ty), mask=mask)
