"""y = x @ W^T (or SiLU(x @ Wg^T) * (x @ Wu^T) over a merged [2N, K] weight, ACT=1) for decode steps of 17 to 256
rows, with the weights as wgmma's A operand: a CTA's BLOCK_N output columns are wgmma's 64-row M and the step's
rows its N (8 to 256), so each weight tile crosses HBM once whatever the rows, while a rows-as-M tile leaves
most of a 64-row M empty or re-reads the weights per 16-row block. Both operands arrive by TMA (rows past M
zero-filled) in TileLang's warp-specialised pipeline. SPLIT > 1 cuts K over the grid's third axis, for GEMMs of
too few column tiles to keep the memory busy (o_proj, down): each slice writes its fp32 sums to a plane of P (of
PLANE_STRIDE rows), which `sum_slices` adds in slice order (replays stay bit-identical), or the next kernel's norm
launch instead (rows.py add_rms_norm's PLANES; the runtime defers the sum: runtime/gpu/planes.py)."""

import tilelang.language as T

from pegainfer.backends.tilelang.kernels.gemm import silu_times

BF16 = T.bfloat16
ROWS_PER_WARPGROUP = T.GemmWarpPolicy.FullRow  # each consumer warpgroup on 64 weight rows, all the step's rows


def swapped(N: int, K: int, ACT: int, BLOCK_N: int, BLOCK_M: int, BLOCK_K: int, STAGES: int, THREADS: int,
            SPLIT: int = 1, MIN_BLOCKS: int = 1, PARTIAL: bool = False, PLANE_STRIDE: int = 0):
    assert not (ACT and SPLIT > 1), "SiLU x up needs whole sums: its K is not split"
    assert K % (BLOCK_K * SPLIT) == 0, f"K={K} must be whole {BLOCK_K}-wide steps in each of {SPLIT} slices"
    assert (SPLIT > 1) == PARTIAL == (PLANE_STRIDE > 0), "a split tile writes planes of PLANE_STRIDE rows"
    M = T.dynamic("M")
    steps = K // BLOCK_K // SPLIT
    w_rows = 2 * N if ACT else N
    store_rows, store_plane = transposed_stores(ACT, BLOCK_N, BLOCK_M, M)

    @T.macro
    def products(A, W, acc, up, bx, by, bz):
        """The slice's sums, transposed: acc[column, row] (and up's). MIN_BLOCKS CTAs an SM: registers capped to fit
        them, as gemm.py's decode tiles."""
        if MIN_BLOCKS > 1:
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            T.disable_warp_group_reg_alloc()
        w_s = T.alloc_shared((BLOCK_N, BLOCK_K), BF16)
        a_s = T.alloc_shared((BLOCK_M, BLOCK_K), BF16)
        T.clear(acc)
        if ACT:
            u_s = T.alloc_shared((BLOCK_N, BLOCK_K), BF16)
            T.clear(up)
            for k in T.Pipelined(steps, num_stages=STAGES):
                T.copy(W[bx * BLOCK_N, k * BLOCK_K], w_s)
                T.copy(W[N + bx * BLOCK_N, k * BLOCK_K], u_s)
                T.copy(A[by * BLOCK_M, k * BLOCK_K], a_s)
                T.gemm(w_s, a_s, acc, transpose_B=True, policy=ROWS_PER_WARPGROUP)
                T.gemm(u_s, a_s, up, transpose_B=True, policy=ROWS_PER_WARPGROUP)
        else:
            for k in T.Pipelined(steps, num_stages=STAGES):
                T.copy(W[bx * BLOCK_N, (bz * steps + k) * BLOCK_K], w_s)
                T.copy(A[by * BLOCK_M, (bz * steps + k) * BLOCK_K], a_s)
                T.gemm(w_s, a_s, acc, transpose_B=True, policy=ROWS_PER_WARPGROUP)

    if SPLIT > 1:
        @T.prim_func
        def swapped(A: T.Tensor((M, K), BF16), W: T.Tensor((N, K), BF16),
                    P: T.Tensor((SPLIT, PLANE_STRIDE, N), T.float32)):
            # the row blocks of one column tile run side by side (blockIdx.x), so the second reads it from L2
            with T.Kernel(T.ceildiv(M, BLOCK_M), N // BLOCK_N, SPLIT, threads=THREADS) as (by, bx, bz):
                acc = T.alloc_fragment((BLOCK_N, BLOCK_M), T.float32)
                c_s = T.alloc_shared((BLOCK_N, BLOCK_M), T.float32)
                products(A, W, acc, None, bx, by, bz)
                store_plane(acc, c_s, P, bx, by, bz)
        return swapped

    @T.prim_func
    def swapped(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16), C: T.Tensor((M, N), BF16)):
        with T.Kernel(T.ceildiv(M, BLOCK_M), N // BLOCK_N, threads=THREADS) as (by, bx):
            acc = T.alloc_fragment((BLOCK_N, BLOCK_M), T.float32)
            up = T.alloc_fragment((BLOCK_N, BLOCK_M), T.float32) if ACT else None
            c_s = T.alloc_shared((BLOCK_N, BLOCK_M), BF16)
            products(A, W, acc, up, bx, by, 0)
            store_rows(acc, up, c_s, C, bx, by)
    return swapped


def transposed_stores(ACT: int, BLOCK_N: int, BLOCK_M: int, M):
    """The swapped tiles' epilogues, their sums held as acc[column, row]: `store_rows` ([SiLU(gate) * up, then]
    back to rows x columns through shared memory, a row's columns side by side) and `store_plane` (a K slice's fp32
    sums into its plane of P)."""
    @T.macro
    def store_rows(acc, up, c_s, C, bx, by):
        if ACT:
            for j, i in T.Parallel(BLOCK_N, BLOCK_M):
                acc[j, i] = silu_times(acc[j, i], up[j, i])
        T.copy(acc, c_s)
        for i, j in T.Parallel(BLOCK_M, BLOCK_N):
            if by * BLOCK_M + i < M:
                C[by * BLOCK_M + i, bx * BLOCK_N + j] = c_s[j, i]

    @T.macro
    def store_plane(acc, c_s, P, bx, by, bz):
        T.copy(acc, c_s)
        for i, j in T.Parallel(BLOCK_M, BLOCK_N):
            if by * BLOCK_M + i < M:
                P[bz, by * BLOCK_M + i, bx * BLOCK_N + j] = c_s[j, i]

    return store_rows, store_plane


def sum_slices(N: int, SPLIT: int, THREADS: int, PLANE_STRIDE: int = 0):
    """C = the SPLIT fp32 planes of a split GEMM added in slice order, rounded to bf16; a CTA a row. Planes of
    PLANE_STRIDE rows (`swapped`'s), or with 0 of the step's M rows (swapped_fp8.py's)."""
    M = T.dynamic("M")

    @T.prim_func
    def sum_slices(P: T.Tensor((SPLIT, PLANE_STRIDE or M, N), T.float32), C: T.Tensor((M, N), BF16)):
        with T.Kernel(M, threads=THREADS) as row:
            total = T.alloc_fragment((1, N), T.float32)
            T.clear(total)
            for s in T.unroll(SPLIT):
                for i, j in T.Parallel(1, N):
                    total[i, j] += P[s, row, j]
            for i, j in T.Parallel(1, N):
                C[row, j] = T.cast(total[i, j], BF16)
    return sum_slices
