"""Concatenation along the last dim, one launch an input: program (row, column tile) copies its tile of the input's
row into the output's columns from OFFSET on (a drafter's features: residual streams side by side)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def copy_columns_kernel(src_ptr, out_ptr, stride_src, stride_out, WIDTH: tl.constexpr, OFFSET: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: the next kernel may start; this one waits for the last's writes
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    values = tl.load(src_ptr + row * stride_src + offs, mask=mask)
    tl.store(out_ptr + row * stride_out + OFFSET + offs, values.to(out_ptr.dtype.element_ty), mask=mask)
