"""y = x @ W^T on the tensor cores, TMA loads into swizzled shared memory and wgmma on sm_90a (mma.sync and
cp.async on sm_80), with an optional epilogue: act(gate) * up over a merged [2N, K] weight (ACT=1: SiLU), or a
residual added to the product (RESIDUAL); `gemm_merged` computes the SiLU x up epilogue with one accumulator for
both halves. The row count M is dynamic; N and K are fixed per kernel. The decode tiles (16 rows on mma.sync) set
MIN_BLOCKS, the CTAs an SM must hold (register cap, no setmaxnreg), and ASYNC_ROWS, the rows by predicated
cp.async instead of a TMA box reaching past M (single GEMMs only: with two, TileLang frees the row stage after the
first, see decode_tile.py)."""

import tilelang.language as T

BF16 = T.bfloat16


def silu_times(gate, up):
    """SiLU(gate) * up with the approximate exp and reciprocal (ex2.approx, rcp.approx, as Triton's epilogue
    lowers them): expf and an IEEE division cost a 128x256 tile's epilogue dearly, and the approximations' error is
    far below the bf16 rounding of the result."""
    return gate * T.fast_rcp(1.0 + T.__exp(-gate)) * up


def gemm(N: int, K: int, ACT: int, RESIDUAL: bool, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, STAGES: int,
         THREADS: int, SWIZZLE: int, FULL_ROW: bool = False, MERGED: bool = False, MIN_BLOCKS: int = 1,
         ASYNC_ROWS: bool = False):
    assert not (ACT and ASYNC_ROWS), "a 16-row SiLU x up tile is decode_tile.py's: TileLang's frees rows too early"
    if MERGED:  # only the SiLU x up epilogue has two halves to merge
        assert ACT == 1 and not RESIDUAL, "a merged tile computes SiLU(gate) * up"
        return gemm_merged(N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, THREADS, SWIZZLE, FULL_ROW)
    M = T.dynamic("M")
    policy = T.GemmWarpPolicy.FullRow if FULL_ROW else T.GemmWarpPolicy.Square
    w_rows = 2 * N if ACT else N

    @T.macro
    def load_rows(A, a_s, by, k, M):
        if ASYNC_ROWS:  # predicated cp.async: rows past M are zero-filled, not read, and no TMA box reaches past M
            for i, j in T.Parallel(BLOCK_M, BLOCK_K):
                a_s[i, j] = T.if_then_else(by * BLOCK_M + i < M, A[by * BLOCK_M + i, k * BLOCK_K + j], T.cast(0, BF16))
        else:
            T.copy(A[by * BLOCK_M, k * BLOCK_K], a_s)

    @T.macro
    def tile(A, W, R, C):
        with T.Kernel(T.ceildiv(N, BLOCK_N), T.ceildiv(M, BLOCK_M), threads=THREADS) as (bx, by):
            a_s = T.alloc_shared((BLOCK_M, BLOCK_K), BF16)
            w_s = T.alloc_shared((BLOCK_N, BLOCK_K), BF16)
            acc = T.alloc_fragment((BLOCK_M, BLOCK_N), T.float32)
            c_s = T.alloc_shared((BLOCK_M, BLOCK_N), BF16)
            T.use_swizzle(SWIZZLE, enable=SWIZZLE > 0)
            if MIN_BLOCKS > 1:
                T.annotate_min_blocks_per_sm(MIN_BLOCKS)
                T.disable_warp_group_reg_alloc()
            T.clear(acc)
            if ACT:
                u_s = T.alloc_shared((BLOCK_N, BLOCK_K), BF16)
                up = T.alloc_fragment((BLOCK_M, BLOCK_N), T.float32)
                T.clear(up)
                for k in T.Pipelined(T.ceildiv(K, BLOCK_K), num_stages=STAGES):
                    load_rows(A, a_s, by, k, M)
                    T.copy(W[bx * BLOCK_N, k * BLOCK_K], w_s)
                    T.copy(W[N + bx * BLOCK_N, k * BLOCK_K], u_s)
                    T.gemm(a_s, w_s, acc, transpose_B=True, policy=policy)
                    T.gemm(a_s, u_s, up, transpose_B=True, policy=policy)
                for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                    acc[i, j] = silu_times(acc[i, j], up[i, j])
            else:
                for k in T.Pipelined(T.ceildiv(K, BLOCK_K), num_stages=STAGES):
                    load_rows(A, a_s, by, k, M)
                    T.copy(W[bx * BLOCK_N, k * BLOCK_K], w_s)
                    T.gemm(a_s, w_s, acc, transpose_B=True, policy=policy)
            if RESIDUAL:
                T.copy(R[by * BLOCK_M, bx * BLOCK_N], c_s)
                for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                    acc[i, j] += T.cast(c_s[i, j], T.float32)
            T.copy(acc, c_s)
            T.copy(c_s, C[by * BLOCK_M, bx * BLOCK_N])

    if RESIDUAL:
        @T.prim_func
        def gemm_residual(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16), R: T.Tensor((M, N), BF16),
                          C: T.Tensor((M, N), BF16)):
            tile(A, W, R, C)
        return gemm_residual

    @T.prim_func
    def gemm(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16), C: T.Tensor((M, N), BF16)):
        tile(A, W, None, C)
    return gemm


def gemm_merged(N: int, K: int, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int, SWIZZLE: int,
                FULL_ROW: bool):
    """SiLU(gate) * up over the merged [2N, K] weight with one accumulator for both halves: a K step loads the gate
    rows and the up rows of the output tile into the two halves of one shared tile, and one wgmma batch (m64nN,
    N = 2 * BLOCK_N, on whole rows) computes both products, reading the A tile once per K step where two GEMMs
    read it twice. wgmma gives a thread the same columns of every 8-column group, so gate column j and up column
    j + BLOCK_N of a row sit in one thread's registers and the epilogue exchanges no data."""
    M = T.dynamic("M")
    policy = T.GemmWarpPolicy.FullRow if FULL_ROW else T.GemmWarpPolicy.Square

    @T.prim_func
    def gemm(A: T.Tensor((M, K), BF16), W: T.Tensor((2 * N, K), BF16), C: T.Tensor((M, N), BF16)):
        with T.Kernel(T.ceildiv(N, BLOCK_N), T.ceildiv(M, BLOCK_M), threads=THREADS) as (bx, by):
            a_s = T.alloc_shared((BLOCK_M, BLOCK_K), BF16)
            w_s = T.alloc_shared((2 * BLOCK_N, BLOCK_K), BF16)  # gate rows, then up rows
            acc = T.alloc_fragment((BLOCK_M, 2 * BLOCK_N), T.float32)
            up = T.alloc_fragment((BLOCK_M, BLOCK_N), T.float32)
            c_s = T.alloc_shared((BLOCK_M, BLOCK_N), BF16)
            T.use_swizzle(SWIZZLE, enable=SWIZZLE > 0)
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, BLOCK_K), num_stages=STAGES):
                T.copy(A[by * BLOCK_M, k * BLOCK_K], a_s)
                T.copy(W[bx * BLOCK_N, k * BLOCK_K], w_s[0:BLOCK_N, :])
                T.copy(W[N + bx * BLOCK_N, k * BLOCK_K], w_s[BLOCK_N:2 * BLOCK_N, :])
                T.gemm(a_s, w_s, acc, transpose_B=True, policy=policy)
            # a T.Parallel loop may index a fragment one way only, so the up half moves to a fragment of its own
            # first (register moves within each thread); the product then lands there in fp32, as in gemm's ACT
            # epilogue, and leaves through stmatrix like any accumulator
            for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                up[i, j] = acc[i, j + BLOCK_N]
            for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                up[i, j] = silu_times(acc[i, j], up[i, j])
            T.copy(up, c_s)
            T.copy(c_s, C[by * BLOCK_M, bx * BLOCK_N])
    return gemm
