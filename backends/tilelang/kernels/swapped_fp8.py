"""y = x @ W^T (ACT 1: SiLU(x @ Wg^T) * (x @ Wu^T) over a merged [2N, K] weight) for decode steps of up to 256
rows, both operands e4m3 (W8A8, as gemm_fp8.py) with the weights as wgmma's A operand, as swapped.py: a CTA's
BLOCK_N output columns are wgmma's 64-row M and the step's rows its N (16 to 128), so each FP8 weight tile crosses
HBM once whatever the rows. A K step is one 128-column group of the rows (their scales AS, loaded whole before the
pipeline) and one block of the weights; its product lands in a fresh accumulator, added to the sums times the row's
scale (and, SCALE 2, the weight block's). SPLIT > 1 cuts K over the grid's third axis into fp32 planes P, which
swapped.py's `sum_slices` adds in slice order. PDL: the launch may start while the rows' quantization finishes."""

import tilelang.language as T

from pegainfer.backends.tilelang.kernels.swapped import transposed_stores

BF16 = T.bfloat16
FP8 = T.float8_e4m3fn
F32 = T.float32
GROUP = 128  # a K step: a row group and a weight block's width
COLUMNS = T.GemmWarpPolicy.FullRow  # each consumer warpgroup on 64 weight rows, all the step's rows


def swapped_fp8(N: int, K: int, ACT: int, SCALE: int, BLOCK_N: int, BLOCK_M: int, STAGES: int, THREADS: int,
                SPLIT: int = 1, MIN_BLOCKS: int = 1, PDL: bool = False):
    assert not (ACT and SPLIT > 1), "SiLU x up needs whole sums: its K is not split"
    assert K % (GROUP * SPLIT) == 0 and SCALE in (1, 2) and GROUP % BLOCK_N == 0, (K, SPLIT, SCALE, BLOCK_N)
    M = T.dynamic("M")
    KB = K // GROUP
    w_rows = 2 * N if ACT else N
    ws_shape = (w_rows // GROUP, KB) if SCALE == 2 else (w_rows, 1)
    products = _products(N, K, ACT, SCALE, BLOCK_N, BLOCK_M, STAGES, SPLIT, MIN_BLOCKS, PDL, M)
    store_rows, store_plane = transposed_stores(ACT, BLOCK_N, BLOCK_M, M)

    if SPLIT > 1:
        @T.prim_func
        def swapped_fp8(A: T.Tensor((M, K), FP8), AS: T.Tensor((M, KB), F32), W: T.Tensor((N, K), FP8),
                        WS: T.Tensor(ws_shape, F32), P: T.Tensor((SPLIT, M, N), F32)):
            with T.Kernel(T.ceildiv(M, BLOCK_M), N // BLOCK_N, SPLIT, threads=THREADS) as (by, bx, bz):
                acc = T.alloc_fragment((BLOCK_N, BLOCK_M), F32)
                c_s = T.alloc_shared((BLOCK_N, BLOCK_M), F32)
                products(A, AS, W, WS, acc, None, bx, by, bz)
                store_plane(acc, c_s, P, bx, by, bz)
        return swapped_fp8

    @T.prim_func
    def swapped_fp8(A: T.Tensor((M, K), FP8), AS: T.Tensor((M, KB), F32), W: T.Tensor((w_rows, K), FP8),
                    WS: T.Tensor(ws_shape, F32), C: T.Tensor((M, N), BF16)):
        with T.Kernel(T.ceildiv(M, BLOCK_M), N // BLOCK_N, threads=THREADS) as (by, bx):
            acc = T.alloc_fragment((BLOCK_N, BLOCK_M), F32)
            up = T.alloc_fragment((BLOCK_N, BLOCK_M), F32) if ACT else None
            c_s = T.alloc_shared((BLOCK_N, BLOCK_M), BF16)
            products(A, AS, W, WS, acc, up, bx, by, 0)
            store_rows(acc, up, c_s, C, bx, by)
    return swapped_fp8


def _products(N: int, K: int, ACT: int, SCALE: int, BLOCK_N: int, BLOCK_M: int, STAGES: int, SPLIT: int,
              MIN_BLOCKS: int, PDL: bool, M):
    KB = K // GROUP
    steps = KB // SPLIT

    @T.macro
    def products(A, AS, W, WS, acc, up, bx, by, bz):
        """The slice's sums, transposed: acc[column, row] (and up's), scaled per row and weight block."""
        if MIN_BLOCKS > 1:
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            T.disable_warp_group_reg_alloc()
        w_s = T.alloc_shared((BLOCK_N, GROUP), FP8)
        a_s = T.alloc_shared((BLOCK_M, GROUP), FP8)
        row_scales = T.alloc_shared((BLOCK_M, KB), F32)
        part = T.alloc_fragment((BLOCK_N, BLOCK_M), F32)
        gate_scale = T.alloc_local((1,), F32)
        if PDL:
            T.pdl_trigger()
            T.pdl_sync()
        T.clear(acc)
        for i, g in T.Parallel(BLOCK_M, KB):
            row_scales[i, g] = T.if_then_else(by * BLOCK_M + i < M, AS[by * BLOCK_M + i, g], 0.0)
        if ACT:
            u_s = T.alloc_shared((BLOCK_N, GROUP), FP8)
            part_up = T.alloc_fragment((BLOCK_N, BLOCK_M), F32)
            up_scale = T.alloc_local((1,), F32)
            T.clear(up)
            for k in T.Pipelined(steps, num_stages=STAGES):
                T.copy(W[bx * BLOCK_N, k * GROUP], w_s)
                T.copy(W[N + bx * BLOCK_N, k * GROUP], u_s)
                T.copy(A[by * BLOCK_M, k * GROUP], a_s)
                T.gemm(w_s, a_s, part, transpose_B=True, clear_accum=True, policy=COLUMNS)
                T.gemm(u_s, a_s, part_up, transpose_B=True, clear_accum=True, policy=COLUMNS)
                gate_scale[0] = WS[bx * BLOCK_N // GROUP, k] if SCALE == 2 else 1.0
                up_scale[0] = WS[(N + bx * BLOCK_N) // GROUP, k] if SCALE == 2 else 1.0
                for c, r in T.Parallel(BLOCK_N, BLOCK_M):
                    acc[c, r] += part[c, r] * row_scales[r, k] * gate_scale[0]
                    up[c, r] += part_up[c, r] * row_scales[r, k] * up_scale[0]
        else:
            for k in T.Pipelined(steps, num_stages=STAGES):
                T.copy(W[bx * BLOCK_N, (bz * steps + k) * GROUP], w_s)
                T.copy(A[by * BLOCK_M, (bz * steps + k) * GROUP], a_s)
                T.gemm(w_s, a_s, part, transpose_B=True, clear_accum=True, policy=COLUMNS)
                gate_scale[0] = WS[bx * BLOCK_N // GROUP, bz * steps + k] if SCALE == 2 else 1.0
                for c, r in T.Parallel(BLOCK_N, BLOCK_M):
                    acc[c, r] += part[c, r] * row_scales[r, bz * steps + k] * gate_scale[0]
        if SCALE == 1:  # a scale per output column, on the finished sums
            for c, r in T.Parallel(BLOCK_N, BLOCK_M):
                acc[c, r] *= WS[bx * BLOCK_N + c, 0]
                if ACT:
                    up[c, r] *= WS[N + bx * BLOCK_N + c, 0]
    return products
