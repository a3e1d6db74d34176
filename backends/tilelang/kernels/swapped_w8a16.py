"""y = x @ W^T (ACT 1: SiLU(x @ Wg^T) * (x @ Wu^T) over a merged [2N, K] weight) for decode steps of up to 256
rows, with e4m3 weights and bf16 rows (W8A16): swapped.py's tile (the weights as wgmma's 64-row M, the step's
rows its N), the weights crossing HBM as FP8 by TMA and widened in registers into wgmma's A fragment (wgmma RS).
SCALE 2 (a scale per 128 x 128 block) multiplies the widened weights before their bf16 rounding, as the dequantize
op rounds them; SCALE 1 (a scale per output column) the finished sums. The rows stay as the step has them, so the
products are the bf16 GEMM's of the dequantized weights. SPLIT > 1 cuts K over the grid's third axis into fp32
planes P, which swapped.py's `sum_slices` adds in slice order. PDL: the launch may start while the step's rows are
normed (and waits for them)."""

import tilelang.language as T

from pegainfer.backends.tilelang.kernels.gemm import silu_times

BF16 = T.bfloat16
FP8 = T.float8_e4m3fn
F32 = T.float32
BLOCK = 128  # a weight scale block's rows and columns, and a K step
COLUMNS = T.GemmWarpPolicy.FullRow  # each consumer warpgroup on 64 weight rows, all the step's rows


def swapped_w8a16(N: int, K: int, ACT: int, SCALE: int, BLOCK_N: int, BLOCK_M: int, STAGES: int, THREADS: int,
                  SPLIT: int = 1, MIN_BLOCKS: int = 1, PDL: bool = False):
    assert not (ACT and SPLIT > 1), "SiLU x up needs whole sums: its K is not split"
    assert K % (BLOCK * SPLIT) == 0 and SCALE in (1, 2) and BLOCK % BLOCK_N == 0, (K, SPLIT, SCALE, BLOCK_N)
    M = T.dynamic("M")
    w_rows = 2 * N if ACT else N
    ws_shape = (w_rows // BLOCK, K // BLOCK) if SCALE == 2 else (w_rows, 1)
    products = _products(N, K, ACT, SCALE, BLOCK_N, BLOCK_M, STAGES, SPLIT, MIN_BLOCKS, PDL)

    if SPLIT > 1:
        @T.prim_func
        def swapped_w8a16(A: T.Tensor((M, K), BF16), W: T.Tensor((N, K), FP8), WS: T.Tensor(ws_shape, F32),
                          P: T.Tensor((SPLIT, M, N), F32)):
            with T.Kernel(T.ceildiv(M, BLOCK_M), N // BLOCK_N, SPLIT, threads=THREADS) as (by, bx, bz):
                acc = T.alloc_fragment((BLOCK_N, BLOCK_M), F32)
                c_s = T.alloc_shared((BLOCK_N, BLOCK_M), F32)
                products(A, W, WS, acc, None, bx, by, bz)
                T.copy(acc, c_s)
                for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                    if by * BLOCK_M + i < M:
                        P[bz, by * BLOCK_M + i, bx * BLOCK_N + j] = c_s[j, i]
        return swapped_w8a16

    @T.prim_func
    def swapped_w8a16(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), FP8), WS: T.Tensor(ws_shape, F32),
                      C: T.Tensor((M, N), BF16)):
        with T.Kernel(T.ceildiv(M, BLOCK_M), N // BLOCK_N, threads=THREADS) as (by, bx):
            acc = T.alloc_fragment((BLOCK_N, BLOCK_M), F32)
            up = T.alloc_fragment((BLOCK_N, BLOCK_M), F32) if ACT else None
            c_s = T.alloc_shared((BLOCK_N, BLOCK_M), BF16)
            products(A, W, WS, acc, up, bx, by, 0)
            if ACT:
                for c, r in T.Parallel(BLOCK_N, BLOCK_M):
                    acc[c, r] = silu_times(acc[c, r], up[c, r])
            T.copy(acc, c_s)
            for i, j in T.Parallel(BLOCK_M, BLOCK_N):  # back to rows x columns, a row's columns side by side
                if by * BLOCK_M + i < M:
                    C[by * BLOCK_M + i, bx * BLOCK_N + j] = c_s[j, i]
    return swapped_w8a16


def _products(N: int, K: int, ACT: int, SCALE: int, BLOCK_N: int, BLOCK_M: int, STAGES: int, SPLIT: int,
              MIN_BLOCKS: int, PDL: bool):
    steps = K // BLOCK // SPLIT

    @T.macro
    def widen(w_s, w_f, WS, row, k):
        """The stored tile into wgmma's A fragment in bf16, times its block's scale (SCALE 2)."""
        scale = T.alloc_local((1,), F32)
        scale[0] = WS[row // BLOCK, k] if SCALE == 2 else 1.0
        for i, j in T.Parallel(BLOCK_N, BLOCK):
            w_f[i, j] = T.cast(T.cast(w_s[i, j], F32) * scale[0], BF16)

    @T.macro
    def products(A, W, WS, acc, up, bx, by, bz):
        """The slice's sums, transposed: acc[column, row] (and up's)."""
        if MIN_BLOCKS > 1:
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            T.disable_warp_group_reg_alloc()
        w_s = T.alloc_shared((BLOCK_N, BLOCK), FP8)
        a_s = T.alloc_shared((BLOCK_M, BLOCK), BF16)
        w_f = T.alloc_fragment((BLOCK_N, BLOCK), BF16)
        if PDL:
            T.pdl_trigger()
            T.pdl_sync()
        T.clear(acc)
        if ACT:
            u_s = T.alloc_shared((BLOCK_N, BLOCK), FP8)
            u_f = T.alloc_fragment((BLOCK_N, BLOCK), BF16)
            T.clear(up)
            for k in T.Pipelined(steps, num_stages=STAGES):
                T.copy(W[bx * BLOCK_N, k * BLOCK], w_s)
                T.copy(W[N + bx * BLOCK_N, k * BLOCK], u_s)
                T.copy(A[by * BLOCK_M, k * BLOCK], a_s)
                widen(w_s, w_f, WS, bx * BLOCK_N, k)
                widen(u_s, u_f, WS, N + bx * BLOCK_N, k)
                T.gemm(w_f, a_s, acc, transpose_B=True, policy=COLUMNS)
                T.gemm(u_f, a_s, up, transpose_B=True, policy=COLUMNS)
        else:
            for k in T.Pipelined(steps, num_stages=STAGES):
                T.copy(W[bx * BLOCK_N, (bz * steps + k) * BLOCK], w_s)
                T.copy(A[by * BLOCK_M, (bz * steps + k) * BLOCK], a_s)
                widen(w_s, w_f, WS, bx * BLOCK_N, bz * steps + k)
                T.gemm(w_f, a_s, acc, transpose_B=True, policy=COLUMNS)
        if SCALE == 1:  # a scale per output column, on the finished sums
            for c, r in T.Parallel(BLOCK_N, BLOCK_M):
                acc[c, r] *= WS[bx * BLOCK_N + c, 0]
                if ACT:
                    up[c, r] *= WS[N + bx * BLOCK_N + c, 0]
    return products
