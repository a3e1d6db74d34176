import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _shrink_row(x_ptr, norm_ptr, a_ptr, slots_ptr, part_ptr, stride_x, row, part, K: tl.constexpr,
                RANK: tl.constexpr, SPLIT_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    """One row's A(x) over one SPLIT_K slice of K, under its adapter's slot of the A table [slots, RANK, K], as
    float32 partial sums [rows, SPLITS, RANK + NORM] that the expand adds up; nothing for slot -1. With NORM, x
    times the norm weight, and the slice's sum of x^2 last (the expand scales by 1/rms)."""
    slot = tl.load(slots_ptr + row)
    width = RANK + NORM
    if slot >= 0:
        squares = tl.zeros((BLOCK_K,), tl.float32)
        for r0 in range(0, RANK, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            acc = tl.zeros((BLOCK_R,), tl.float32)
            for k0 in range(0, SPLIT_K, BLOCK_K):
                k = part * SPLIT_K + k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
                if NORM:
                    if r0 == 0:
                        squares += x * x
                    x = x * tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + (slot * RANK + r[:, None]) * K + k[None, :],
                            mask=(r[:, None] < RANK) & (k[None, :] < K), other=0.0).to(tl.float32)
                acc += tl.sum(a * x[None, :], axis=1)
            tl.store(part_ptr + (row * SPLITS + part) * width + r, acc, mask=r < RANK)
        if NORM:
            tl.store(part_ptr + (row * SPLITS + part) * width + RANK, tl.sum(squares, axis=0))


@triton.jit
def _one_slot(slots_ptr, m, M):
    """The slot every one of rows m (those below M) has, or -1 where they differ or have none."""
    slots = tl.load(slots_ptr + m, mask=m < M, other=-1)
    slot = tl.max(slots, axis=0)
    return tl.where(tl.min(tl.where(m < M, slots, slot), axis=0) == slot, slot, -1)


@triton.jit
def lora_shrink_kernel(x_ptr, norm_ptr, a_ptr, slots_ptr, part_ptr, stride_x, M, K: tl.constexpr, RANK: tl.constexpr,
                       SPLIT_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """A program a row and slice of K (a decode step's few rows still spread the table's read over the SMs); where
    the BLOCK_M rows around it share one adapter (a prompt chunk's, a step's of one adapter), the block's first
    row's program takes them all, reading the A tile once for a tensor-core product, and the others stop."""
    if PDL:  # programmatic dependent launch (see kernels/gemm.py)
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    part = tl.program_id(1)
    m = row // BLOCK_M * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = _one_slot(slots_ptr, m, M)
    width = RANK + NORM
    if slot < 0:
        _shrink_row(x_ptr, norm_ptr, a_ptr, slots_ptr, part_ptr, stride_x, row, part, K, RANK, SPLIT_K, SPLITS,
                    BLOCK_R, BLOCK_K, NORM)
    elif row % BLOCK_M == 0:
        squares = tl.zeros((BLOCK_M,), tl.float32)
        for r0 in range(0, RANK, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
            for k0 in range(0, SPLIT_K, BLOCK_K):
                k = part * SPLIT_K + k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K),
                            other=0.0).to(tl.float32)
                if NORM:
                    if r0 == 0:
                        squares += tl.sum(x * x, axis=1)
                    x = x * tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
                a = tl.load(a_ptr + (slot * RANK + r[:, None]) * K + k[None, :],
                            mask=(r[:, None] < RANK) & (k[None, :] < K), other=0.0)
                acc += tl.dot(x, tl.trans(a.to(tl.float32)))  # tf32 on the GPU: the update's few bits are enough
            tl.store(part_ptr + (m[:, None] * SPLITS + part) * width + r[None, :], acc,
                     mask=(m[:, None] < M) & (r[None, :] < RANK))
        if NORM:
            tl.store(part_ptr + (m * SPLITS + part) * width + RANK, squares, mask=m < M)


@triton.jit
def _expand_row(part_ptr, b_ptr, scale_ptr, slots_ptr, base_ptr, out_ptr, stride_base, stride_out, row, n,
                N: tl.constexpr, K: tl.constexpr, RANK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_N: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, ADD: tl.constexpr):
    """A row's scale x B(shrunk) for the outputs n, B the slot's [N, RANK], shrunk the sum of the shrink's
    partials (with NORM, times the row's 1/rms over its K inputs); with ADD, the row of `base` plus that (written in
    place: a row of slot -1 is left as it is), else that alone (zeros for slot -1)."""
    slot = tl.load(slots_ptr + row)
    width = RANK + NORM
    if slot >= 0:
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for r0 in range(0, RANK, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            shrunk = tl.zeros((BLOCK_R,), tl.float32)
            for s in range(SPLITS):
                shrunk += tl.load(part_ptr + (row * SPLITS + s) * width + r, mask=r < RANK, other=0.0)
            b = tl.load(b_ptr + (slot * N + n[:, None]) * RANK + r[None, :],
                        mask=(n[:, None] < N) & (r[None, :] < RANK), other=0.0).to(tl.float32)
            acc += tl.sum(b * shrunk[None, :], axis=1)
        acc = acc * tl.load(scale_ptr + slot)
        if NORM:
            squares = 0.0
            for s in range(SPLITS):
                squares += tl.load(part_ptr + (row * SPLITS + s) * width + RANK)
            acc = acc / tl.sqrt(squares / K + EPS)
        if ADD:
            acc += tl.load(base_ptr + row * stride_base + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)
    elif not ADD:
        tl.store(out_ptr + row * stride_out + n, tl.zeros((BLOCK_N,), out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def lora_expand_kernel(part_ptr, b_ptr, scale_ptr, slots_ptr, base_ptr, out_ptr, stride_base, stride_out, M,
                       N: tl.constexpr, K: tl.constexpr, RANK: tl.constexpr, SPLITS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, NORM: tl.constexpr,
                       EPS: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    """A program a row and tile of outputs; where the BLOCK_M rows around it share one adapter, the block's first
    row's program takes them all, reading the B tile once for a tensor-core product. BLOCK_R holds the whole
    rank."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    m = row // BLOCK_M * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = _one_slot(slots_ptr, m, M)
    width = RANK + NORM
    if slot < 0:
        _expand_row(part_ptr, b_ptr, scale_ptr, slots_ptr, base_ptr, out_ptr, stride_base, stride_out, row, n, N, K,
                    RANK, SPLITS, BLOCK_R, BLOCK_N, NORM, EPS, ADD)
    elif row % BLOCK_M == 0:
        r = tl.arange(0, BLOCK_R)
        shrunk = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
        for s in range(SPLITS):
            shrunk += tl.load(part_ptr + (m[:, None] * SPLITS + s) * width + r[None, :],
                              mask=(m[:, None] < M) & (r[None, :] < RANK), other=0.0)
        if NORM:
            squares = tl.zeros((BLOCK_M,), tl.float32)
            for s in range(SPLITS):
                squares += tl.load(part_ptr + (m * SPLITS + s) * width + RANK, mask=m < M, other=0.0)
            shrunk = shrunk / tl.sqrt(squares / K + EPS)[:, None]
        b = tl.load(b_ptr + (slot * N + n[:, None]) * RANK + r[None, :], mask=(n[:, None] < N) & (r[None, :] < RANK),
                    other=0.0)
        acc = tl.dot(shrunk, tl.trans(b.to(tl.float32))) * tl.load(scale_ptr + slot)
        mask = (m[:, None] < M) & (n[None, :] < N)
        if ADD:
            acc += tl.load(base_ptr + m[:, None] * stride_base + n[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
