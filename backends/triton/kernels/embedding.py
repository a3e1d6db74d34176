"""Embedding lookup: one program per (token, column tile) copies a row of the table, times SCALE (1: a copy). With
FIRST_ID >= 0 the table is one rank's ROWS ids of the vocabulary from FIRST_ID on. Ids outside the table give
zeros: never a read past it (an unresolved draw, -1, that a step in flight hands the next one)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def embedding_kernel(ids_ptr, table_ptr, out_ptr, stride_out, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                     SCALE: tl.constexpr, FIRST_ID: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: the next kernel may start; this one waits for the last's writes
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    row = tl.load(ids_ptr + token).to(tl.int64)
    if FIRST_ID >= 0:
        row = row - FIRST_ID
    mask = mask & (row >= 0) & (row < ROWS)
    values = tl.load(table_ptr + row * HIDDEN + offs, mask=mask, other=0.0)
    if SCALE != 1.0:
        values = values.to(tl.float32) * SCALE
    tl.store(out_ptr + token * stride_out + offs, values.to(out_ptr.dtype.element_ty), mask=offs < HIDDEN)
