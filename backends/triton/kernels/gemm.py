"""The GEMM family: y = x @ W^T with an optional prologue (residual add, row gather, RMSNorm folded in as a row
scale) and epilogue (bias, act(gate) * up over a merged [2N, K] weight), specialised by constexprs. Four kernels
share them: linear_kernel on the tensor cores (prefill, and decode steps of up to 16 rows in 16-row tiles),
linear_split_kernel, its form with K split over programs (decode), gemv_row_kernel for one row per program
(batch-1 decode), and gemv_rows_kernel, its form for a few rows. (norm_rows.py runs the norm prologue as a launch of
its own before the 16-row decode tiles.) FP8 weights (SCALE; scale_ptr) are scaled in registers: a scale
per output column (SCALE 1) the finished sums, a SCALE_N x SCALE_K block's (2) each K tile's, within one block."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# include: fp8.py


@triton.jit
def dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b. UPCAST (set only under Triton's CPU interpreter, whose bf16 dot is wrong in 3.6) multiplies in
    float32, which gives the same sums: a product of two bf16 values is exact in float32."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _load_rows(x_ptr, x2_ptr, rows, stride_x, stride_x2, offs_k, mask_m, mask_k, ADD: tl.constexpr):
    mask = mask_m[:, None] & mask_k[None, :]
    a = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:
        a += tl.load(x2_ptr + rows[:, None] * stride_x2 + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    return a


@triton.jit
def _activate(gate, ACT: tl.constexpr):
    if ACT == 1:  # silu
        out = gate / (1.0 + tl.exp(-gate))
    else:  # gelu with the tanh approximation
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    return out


@triton.jit
def _tile_rows(rows_ptr, M, GATHER: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's output rows, their mask, and the input rows they read (gathered, for the LM-head tail)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    if GATHER:
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0)
    else:
        rows = offs_m
    return offs_m, mask_m, rows


@triton.jit
def _inverse_rms(x_ptr, x2_ptr, sum_ptr, rows, offs_m, mask_m, stride_x, stride_x2, stride_sum,
                 K: tl.constexpr, EPS: tl.constexpr, ADD: tl.constexpr, WRITE_SUM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """A first pass over the rows: 1/rms of each (and the residual sum, written by the first column tile)."""
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = _load_rows(x_ptr, x2_ptr, rows, stride_x, stride_x2, offs_k, mask_m, mask_k, ADD)
        if WRITE_SUM:
            tl.store(sum_ptr + offs_m[:, None] * stride_sum + offs_k[None, :], a.to(sum_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & mask_k[None, :] & (tl.program_id(1) == 0))
        squares += tl.sum(a * a, axis=1)
    return 1.0 / tl.sqrt(squares / K + EPS)


@triton.jit
def _activation_tile(x_ptr, x2_ptr, norm_ptr, rows, rstd, stride_x, stride_x2, offs_k, mask_m, mask_k,
                     ADD: tl.constexpr, NORM: tl.constexpr, NORM_OFFSET: tl.constexpr):
    a = _load_rows(x_ptr, x2_ptr, rows, stride_x, stride_x2, offs_k, mask_m, mask_k, ADD)
    if NORM:  # the norm scales by weight + NORM_OFFSET (1 for norms that scale by 1 + weight)
        weight = tl.load(norm_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32) + NORM_OFFSET
        a = a * rstd[:, None] * weight[None, :]
    return a


@triton.jit
def _store(acc, up, bias_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_out, N: tl.constexpr,
           BIAS: tl.constexpr, ACT: tl.constexpr, scale_ptr, SCALE: tl.constexpr):
    """The epilogue: an FP8 weight's column scales, bias, act(gate) * up for a merged gate/up weight, the store."""
    if SCALE == 1:
        acc *= tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        if ACT != 0:
            up *= tl.load(scale_ptr + N + offs_n, mask=mask_n, other=0.0)[None, :]
    if BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            up += tl.load(bias_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if ACT != 0:
        acc = _activate(acc, ACT) * up
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _operand(a, w_ptr, out_ptr, SCALE: tl.constexpr):
    """The rows in the weights' type, as the tensor cores take them (an FP8 weight's: the output's)."""
    return a.to(out_ptr.dtype.element_ty if SCALE else w_ptr.dtype.element_ty)


@triton.jit
def _block_scales(scale_ptr, offs_n, mask_n, k0, N: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
                  SCALE_N: tl.constexpr, SCALE_K: tl.constexpr):
    """The scales of the K tile at k0 (within one block of SCALE_K columns), a column each, and of its up half."""
    blocks: tl.constexpr = (K + SCALE_K - 1) // SCALE_K
    s = tl.load(scale_ptr + (offs_n // SCALE_N) * blocks + k0 // SCALE_K, mask=mask_n, other=0.0)
    s_up = s
    if ACT != 0:
        s_up = tl.load(scale_ptr + ((N + offs_n) // SCALE_N) * blocks + k0 // SCALE_K, mask=mask_n, other=0.0)
    return s, s_up


@triton.jit
def _prologue(x_ptr, x2_ptr, rows_ptr, sum_ptr, M, stride_x, stride_x2, stride_sum, N: tl.constexpr, K: tl.constexpr,
              EPS: tl.constexpr, ADD: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr, WRITE_SUM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """What linear_kernel does before its K loop: wait for the previous kernel (programmatic
    dependent launch: the next kernel may start now), this program's rows and columns, and each row's 1/rms."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs_m, mask_m, rows = _tile_rows(rows_ptr, M, GATHER, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        rstd = _inverse_rms(x_ptr, x2_ptr, sum_ptr, rows, offs_m, mask_m, stride_x, stride_x2, stride_sum, K, EPS,
                            ADD, WRITE_SUM, BLOCK_M, BLOCK_K)
    return offs_m, mask_m, rows, offs_n, offs_n < N, rstd


@triton.jit
def linear_kernel(x_ptr, x2_ptr, rows_ptr, norm_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, sum_ptr,
                  M, stride_x, stride_x2, stride_out, stride_sum,
                  N: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr,
                  ADD: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                  ACT: tl.constexpr, WRITE_SUM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
                  NORM_OFFSET: tl.constexpr, SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                  PDL: tl.constexpr = False):
    offs_m, mask_m, rows, offs_n, mask_n, rstd = _prologue(
        x_ptr, x2_ptr, rows_ptr, sum_ptr, M, stride_x, stride_x2, stride_sum, N, K, EPS, ADD, GATHER, NORM, WRITE_SUM,
        BLOCK_M, BLOCK_N, BLOCK_K, PDL)
    acc, up = _products(x_ptr, x2_ptr, norm_ptr, w_ptr, scale_ptr, out_ptr, rows, rstd, stride_x, stride_x2, offs_m,
                        mask_m, offs_n, mask_n, 0, K, N, K, ADD, NORM, NORM_OFFSET, ACT, BLOCK_M, BLOCK_N, BLOCK_K,
                        UPCAST_DOT, SCALE, SCALE_N, SCALE_K)
    _store(acc, up, bias_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_out, N, BIAS, ACT, scale_ptr, SCALE)


@triton.jit
def _products(x_ptr, x2_ptr, norm_ptr, w_ptr, scale_ptr, out_ptr, rows, rstd, stride_x, stride_x2, offs_m, mask_m,
              offs_n, mask_n, k_start, k_stop, N: tl.constexpr, K: tl.constexpr, ADD: tl.constexpr,
              NORM: tl.constexpr, NORM_OFFSET: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr, SCALE: tl.constexpr,
              SCALE_N: tl.constexpr, SCALE_K: tl.constexpr):
    """The tile's products over K from k_start to k_stop on the tensor cores: gate (or the only) and up sums."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = _activation_tile(x_ptr, x2_ptr, norm_ptr, rows, rstd, stride_x, stride_x2, offs_k, mask_m, mask_k,
                             ADD, NORM, NORM_OFFSET)
        if not UPCAST_DOT:  # the tensor cores take the weights' type (the interpreter's casts truncate: skip)
            a = _operand(a, w_ptr, out_ptr, SCALE)
        w_mask = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
        w_up = w
        if ACT != 0:
            w_up = tl.load(w_ptr + (N + offs_n[:, None]) * K + offs_k[None, :], mask=w_mask, other=0.0)
        if SCALE != 0:  # FP8 values are exact in the rows' type (bf16's: times 2^-120, undone below)
            w, w_up = widen_e4m3(w, a.dtype, UPCAST_DOT), widen_e4m3(w_up, a.dtype, UPCAST_DOT)
        if SCALE == 2:
            s, s_up = _block_scales(scale_ptr, offs_n, mask_n, k0, N, K, ACT, SCALE_N, SCALE_K)
            acc += dot(a, tl.trans(w), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST_DOT) * s[None, :]
            if ACT != 0:
                up += dot(a, tl.trans(w_up), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), UPCAST_DOT) \
                    * s_up[None, :]
        else:
            acc = dot(a, tl.trans(w), acc, UPCAST_DOT)
            if ACT != 0:
                up = dot(a, tl.trans(w_up), up, UPCAST_DOT)
    if SCALE != 0 and not UPCAST_DOT and out_ptr.dtype.element_ty == tl.bfloat16:  # the rows were bf16
        acc, up = acc * BF16_LIFT, up * BF16_LIFT
    return acc, up


@triton.jit
def linear_split_kernel(x_ptr, x2_ptr, rows_ptr, norm_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, sum_ptr, part_ptr,
                        count_ptr, M, stride_x, stride_x2, stride_out, stride_sum,
                        N: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr,
                        ADD: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                        ACT: tl.constexpr, WRITE_SUM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                        UPCAST_DOT: tl.constexpr, NORM_OFFSET: tl.constexpr, SCALE: tl.constexpr,
                        SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, PDL: tl.constexpr = False):
    """linear_kernel with K cut into SPLIT slices, one program each (grid axis 2): for decode steps, whose column
    tiles alone are too few programs, each streaming too long a K, to keep the memory busy. The slices meet in
    _meet_slices (count_ptr: one ticket a tile)."""
    offs_m, mask_m, rows, offs_n, mask_n, rstd = _prologue(
        x_ptr, x2_ptr, rows_ptr, sum_ptr, M, stride_x, stride_x2, stride_sum, N, K, EPS, ADD, GATHER, NORM, WRITE_SUM,
        BLOCK_M, BLOCK_N, BLOCK_K, PDL)
    per_split: tl.constexpr = (K + SPLIT * BLOCK_K - 1) // (SPLIT * BLOCK_K) * BLOCK_K
    k_start = tl.program_id(2) * per_split
    acc, up = _products(x_ptr, x2_ptr, norm_ptr, w_ptr, scale_ptr, out_ptr, rows, rstd, stride_x, stride_x2, offs_m,
                        mask_m, offs_n, mask_n, k_start, k_start + per_split, N, K, ADD, NORM, NORM_OFFSET, ACT,
                        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_DOT, SCALE, SCALE_N, SCALE_K)
    counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    _meet_slices(acc, up, part_ptr, counter, SPLIT, bias_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_out,
                 N, BIAS, ACT, BLOCK_M, BLOCK_N, scale_ptr, SCALE)


@triton.jit
def _meet_slices(acc, up, part_ptr, counter, SPLIT: tl.constexpr, bias_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n,
                 stride_out, N: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, scale_ptr, SCALE: tl.constexpr):
    """Stores this slice's float32 sums in its own plane of part_ptr ([SPLIT, BLOCK_M, N or 2N]: the rows fit one
    row tile); the program whose ticket completes the tile adds the planes in slice order, resets the ticket
    (zeroed once by the runtime) and runs the epilogue. The order makes the sums the same whichever program comes
    last: replays are bit-identical, which atomic adds would not be."""
    width: tl.constexpr = 2 * N if ACT != 0 else N
    plane: tl.constexpr = BLOCK_M * width
    part = part_ptr + offs_m[:, None] * width + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tl.store(part + tl.program_id(2) * plane, acc, mask=mask)
    if ACT != 0:
        tl.store(part + tl.program_id(2) * plane + N, up, mask=mask)
    tl.debug_barrier()  # every thread's sums are stored before the ticket (its release covers them)
    if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for index in tl.static_range(SPLIT):  # from L2 (.cg): the other programs' stores, not a stale L1 line
            acc += tl.load(part + index * plane, mask=mask, other=0.0, cache_modifier=".cg")
            if ACT != 0:
                up += tl.load(part + index * plane + N, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)
        _store(acc, up, bias_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_out, N, BIAS, ACT, scale_ptr, SCALE)


@triton.jit
def gemv_row_kernel(x_ptr, x2_ptr, rows_ptr, norm_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, sum_ptr,
                    M, stride_x, stride_x2, stride_out, stride_sum,
                    N: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr,
                    ADD: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                    ACT: tl.constexpr, WRITE_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, RMS_BLOCK: tl.constexpr, UPCAST_DOT: tl.constexpr,
                    NORM_OFFSET: tl.constexpr, SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                    PDL: tl.constexpr = False):
    """A GEMV with one row per program (BLOCK_M must be 1) and two-dimensional tiles: the activation is
    loaded straight into the weight tile's column layout, so no layout change (a round trip through shared
    memory and a barrier) sits in the K loop that streams the weights. The next weight tile is loaded one step
    ahead, and the first before waiting on the previous kernel: weights never depend on it."""
    if PDL:
        gdc_launch_dependents()
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w, w_up = _weight_tiles(w_ptr, offs_n, mask_n, 0, N, K, ACT, BLOCK_K)
    if PDL:  # only now read what the previous kernel wrote
        gdc_wait()
    m = tl.program_id(0)
    valid = m < M
    row = tl.load(rows_ptr + m, mask=valid, other=0) if GATHER else m
    rstd = 1.0
    if NORM:  # in wide chunks: each chunk's loads wait for the last, so few chunks keep this prologue short
        squares = tl.zeros([RMS_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, RMS_BLOCK):
            offs_k = k0 + tl.arange(0, RMS_BLOCK)
            a = _load_row(x_ptr, x2_ptr, row, stride_x, stride_x2, offs_k, valid & (offs_k < K), ADD)
            if WRITE_SUM:
                tl.store(sum_ptr + m * stride_sum + offs_k, a.to(sum_ptr.dtype.element_ty),
                         mask=valid & (offs_k < K) & (tl.program_id(1) == 0))
            squares += a * a
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + EPS)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = _load_row(x_ptr, x2_ptr, row, stride_x, stride_x2, offs_k, valid & mask_k, ADD)
        if NORM:  # weight + NORM_OFFSET, as _activation_tile
            a = a * rstd * (tl.load(norm_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32) + NORM_OFFSET)
        if not UPCAST_DOT:  # round the activation as the tensor-core path does
            a = _operand(a, w_ptr, out_ptr, SCALE).to(tl.float32)
        w_next, w_up_next = _weight_tiles(w_ptr, offs_n, mask_n, k0 + BLOCK_K, N, K, ACT, BLOCK_K)
        w, w_up = w.to(tl.float32), w_up.to(tl.float32)
        if SCALE == 2:
            s, s_up = _block_scales(scale_ptr, offs_n, mask_n, k0, N, K, ACT, SCALE_N, SCALE_K)
            w, w_up = w * s[:, None], w_up * s_up[:, None]
        acc += w * a[None, :]
        if ACT != 0:
            up += w_up * a[None, :]
        w, w_up = w_next, w_up_next
    offs_m = tl.full([1], 0, tl.int32) + m
    _store(tl.sum(acc, axis=1)[None, :], tl.sum(up, axis=1)[None, :], bias_ptr, out_ptr, offs_m, offs_m < M,
           offs_n, mask_n, stride_out, N, BIAS, ACT, scale_ptr, SCALE)


@triton.jit
def _weight_tiles(w_ptr, offs_n, mask_n, k0, N: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at column k0 (past K: masked, nothing read), and its up half."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = mask_n[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
    w_up = w
    if ACT != 0:
        w_up = tl.load(w_ptr + (N + offs_n[:, None]) * K + offs_k[None, :], mask=mask, other=0.0)
    return w, w_up


@triton.jit
def _load_row(x_ptr, x2_ptr, row, stride_x, stride_x2, offs_k, mask, ADD: tl.constexpr):
    a = tl.load(x_ptr + row * stride_x + offs_k, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        a += tl.load(x2_ptr + row * stride_x2 + offs_k, mask=mask, other=0.0).to(tl.float32)
    return a


@triton.jit
def gemv_rows_kernel(x_ptr, x2_ptr, rows_ptr, norm_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, sum_ptr,
                     M, stride_x, stride_x2, stride_out, stride_sum,
                     N: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr,
                     ADD: tl.constexpr, GATHER: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                     ACT: tl.constexpr, WRITE_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, RMS_BLOCK: tl.constexpr, UPCAST_DOT: tl.constexpr,
                     NORM_OFFSET: tl.constexpr, SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                     PDL: tl.constexpr = False, VEC: tl.constexpr = 1):
    """gemv_row_kernel for BLOCK_M rows a program: each weight tile is read once for all of them. Weights and
    activations are loaded as three-dimensional tiles ([1, N, K] and [M, 1, K]) so that the products need no
    layout change inside the K loop. VEC > 1 sums each run of VEC neighbouring products at once (a thread's own
    vector load), so the accumulators are VEC times fewer and wider column tiles fit the registers."""
    if PDL:
        gdc_launch_dependents()
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w, w_up = _weight_tiles3(w_ptr, offs_n, mask_n, 0, N, K, ACT, BLOCK_K)
    if PDL:
        gdc_wait()
    offs_m, mask_m, rows = _tile_rows(rows_ptr, M, GATHER, BLOCK_M)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        rstd = _inverse_rms(x_ptr, x2_ptr, sum_ptr, rows, offs_m, mask_m, stride_x, stride_x2, stride_sum, K, EPS,
                            ADD, WRITE_SUM, BLOCK_M, RMS_BLOCK)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask = mask_m[:, None, None] & mask_k[None, None, :]
        a = tl.load(x_ptr + rows[:, None, None] * stride_x + offs_k[None, None, :], mask=mask, other=0.0)
        a = a.to(tl.float32)
        if ADD:
            a += tl.load(x2_ptr + rows[:, None, None] * stride_x2 + offs_k[None, None, :], mask=mask,
                         other=0.0).to(tl.float32)
        if NORM:
            scale = tl.load(norm_ptr + offs_k[None, None, :], mask=mask_k[None, None, :], other=0.0)
            a = a * rstd[:, None, None] * (scale.to(tl.float32) + NORM_OFFSET)
        if not UPCAST_DOT:
            a = _operand(a, w_ptr, out_ptr, SCALE).to(tl.float32)
        w_next, w_up_next = _weight_tiles3(w_ptr, offs_n, mask_n, k0 + BLOCK_K, N, K, ACT, BLOCK_K)
        w, w_up = w.to(tl.float32), w_up.to(tl.float32)
        if SCALE == 2:
            s, s_up = _block_scales(scale_ptr, offs_n, mask_n, k0, N, K, ACT, SCALE_N, SCALE_K)
            w, w_up = w * s[None, :, None], w_up * s_up[None, :, None]
        acc += _vector_sums(w * a, BLOCK_M, BLOCK_N, BLOCK_K, VEC)
        if ACT != 0:
            up += _vector_sums(w_up * a, BLOCK_M, BLOCK_N, BLOCK_K, VEC)
        w, w_up = w_next, w_up_next
    _store(tl.sum(acc, axis=2), tl.sum(up, axis=2), bias_ptr, out_ptr, offs_m, mask_m, offs_n, mask_n, stride_out,
           N, BIAS, ACT, scale_ptr, SCALE)


@triton.jit
def _vector_sums(products, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    if VEC > 1:
        products = tl.sum(tl.reshape(products, [BLOCK_M, BLOCK_N, BLOCK_K // VEC, VEC]), axis=3)
    return products


@triton.jit
def _weight_tiles3(w_ptr, offs_n, mask_n, k0, N: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """_weight_tiles as [1, BLOCK_N, BLOCK_K] tiles."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = mask_n[None, :, None] & (offs_k < K)[None, None, :]
    w = tl.load(w_ptr + offs_n[None, :, None] * K + offs_k[None, None, :], mask=mask, other=0.0)
    w_up = w
    if ACT != 0:
        w_up = tl.load(w_ptr + (N + offs_n[None, :, None]) * K + offs_k[None, None, :], mask=mask, other=0.0)
    return w, w_up
