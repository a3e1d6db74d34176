"""The decode GEMV family in CuTe DSL: y[m, n] = sum_k a[m, k] W[n, k] for up to ROWS rows (a batch bucket),
with the GEMM family's prologue (residual add, RMSNorm: a = (x + x2) * rstd * (g + NORM_OFFSET), rounded to bf16 as
the tensor cores would read it; NORM_OFFSET 1 for a norm that scales by 1 + g) and epilogue (SiLU(gate) * up over a
merged [2N, K] weight). Each warp streams COLS weight rows with 16-byte loads, keeps ROWS x COLS sums per lane, and
reduces them across the warp once at the end.

Parameters are fixed whatever the flags: (x, x2, g, w, y, s, m); the plan passes x for an unused tensor."""

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.runtime import make_fake_compact_tensor

VEC = 8  # bf16 elements per 16-byte load


def _loaders(ADD: bool, NORM: bool, NORM_OFFSET: float):
    """(load, activation): 8 bf16 of a row as fp32, and a row's chunk of the GEMM's operand after the prologue."""
    @cute.jit
    def load(t: cute.Tensor, row, chunk):
        view = cute.local_tile(t[row, None], (VEC,), (chunk,))
        frag = cute.make_rmem_tensor_like(view)
        cute.autovec_copy(view, frag)
        return frag.load().to(Float32)

    @cute.jit
    def activation(x: cute.Tensor, x2: cute.Tensor, g: cute.Tensor, rstd: cute.Tensor, row, chunk):
        a = load(x, row, chunk)
        if cutlass.const_expr(ADD):
            a = a + load(x2, row, chunk)
        if cutlass.const_expr(NORM):
            gv = cute.local_tile(g, (VEC,), (chunk,))
            gf = cute.make_rmem_tensor_like(gv)
            cute.autovec_copy(gv, gf)
            scaled = a * rstd[row]  # before G's load: a plain norm's PTX stays what it was
            weight = gf.load().to(Float32)
            if cutlass.const_expr(NORM_OFFSET != 0.0):  # a norm that scales by 1 + g; none traced for a plain one
                weight = weight + NORM_OFFSET
            a = (scaled * weight).to(BFloat16).to(Float32)
        return a

    return load, activation


def _row_scales(ROWS: int, K: int, ADD: bool, WRITE_SUM: bool, EPS: float, WARPS: int, load):
    iters = K // (32 * VEC)

    @cute.jit
    def row_scales(x: cute.Tensor, x2: cute.Tensor, s: cute.Tensor, rstd: cute.Tensor, m, warp, lane, bidx):
        """1/rms of each row into rstd, a warp a row (its residual sum written by the first block)."""
        for r in cutlass.range_constexpr(ROWS):
            if warp == r % WARPS and r < m:
                squares = Float32(0.0)
                for it in cutlass.range(iters, unroll=2):
                    chunk = lane + 32 * it
                    v = load(x, r, chunk)
                    if cutlass.const_expr(ADD):
                        v = v + load(x2, r, chunk)
                    if cutlass.const_expr(WRITE_SUM):
                        if bidx == 0:
                            out = cute.local_tile(s[r, None], (VEC,), (chunk,))
                            frag = cute.make_rmem_tensor_like(out)
                            frag.store(v.to(BFloat16))
                            cute.autovec_copy(frag, out)
                    squares += (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                squares = cute.arch.warp_reduction(squares, lambda a, b: a + b)
                if lane == 0:
                    rstd[r] = cute.math.rsqrt(squares / K + EPS)

    return row_scales


def gemv(ROWS: int, N: int, K: int, ACT: int, NORM: bool, ADD: bool, WRITE_SUM: bool, EPS: float, COLS: int,
         WARPS: int, NORM_OFFSET: float = 0.0):
    iters = K // (32 * VEC)
    per_cta = COLS * WARPS
    unroll = 2 if ROWS <= 4 else 1  # 16 rows are 32 loads an iteration already; unrolling only slows compiling

    load, activation = _loaders(ADD, NORM, NORM_OFFSET)
    row_scales = _row_scales(ROWS, K, ADD, WRITE_SUM, EPS, WARPS, load)

    @cute.kernel
    def gemv_kernel(x: cute.Tensor, x2: cute.Tensor, g: cute.Tensor, w: cute.Tensor, y: cute.Tensor,
                    s: cute.Tensor, m: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        smem = cutlass.memory.SmemAllocator()
        rstd = smem.allocate_tensor(Float32, cute.make_layout(ROWS), 16)
        if cutlass.const_expr(NORM):
            row_scales(x, x2, s, rstd, m, warp, lane, bidx)
            cute.arch.sync_threads()
        acc = cute.make_rmem_tensor((ROWS, COLS), Float32)
        acc.fill(0.0)
        up = cute.make_rmem_tensor((ROWS, COLS), Float32)
        up.fill(0.0)
        first = bidx * per_cta + warp * COLS
        for it in cutlass.range(iters, unroll=unroll):
            chunk = lane + 32 * it
            for r in cutlass.range_constexpr(ROWS):
                if r < m:
                    a = activation(x, x2, g, rstd, r, chunk)
                    for c in cutlass.range_constexpr(COLS):
                        acc[r, c] += (a * load(w, first + c, chunk)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        if cutlass.const_expr(ACT == 1):
                            up[r, c] += (a * load(w, N + first + c, chunk)).reduce(
                                cute.ReductionOp.ADD, Float32(0.0), 0)
        for r in cutlass.range_constexpr(ROWS):
            for c in cutlass.range_constexpr(COLS):
                total = cute.arch.warp_reduction(acc[r, c], lambda a, b: a + b)
                if cutlass.const_expr(ACT == 1):
                    gate = total
                    total = gate / (1.0 + cute.math.exp(-gate)) * cute.arch.warp_reduction(up[r, c],
                                                                                           lambda a, b: a + b)
                if lane == 0 and r < m:
                    y[r, first + c] = total.to(BFloat16)

    @cute.jit
    def gemv(x: cute.Tensor, x2: cute.Tensor, g: cute.Tensor, w: cute.Tensor, y: cute.Tensor, s: cute.Tensor,
             m: Int32):
        gemv_kernel(x, x2, g, w, y, s, m).launch(grid=(N // per_cta, 1, 1), block=(32 * WARPS, 1, 1))

    def tensor(*shape):
        return make_fake_compact_tensor(BFloat16, shape, stride_order=tuple(reversed(range(len(shape)))),
                                        assumed_align=16)

    w_rows = 2 * N if ACT else N
    fakes = (tensor(ROWS, K), tensor(ROWS, K), tensor(K), tensor(w_rows, K), tensor(ROWS, N), tensor(ROWS, K),
             Int32(ROWS))
    return gemv, fakes
