"""y = x @ W^T, or SiLU(x @ Wg^T) * (x @ Wu^T) over a merged [2N, K] weight (ACT=1), for decode steps of up to 16
rows: one 16-row tile a CTA, warp-specialised by hand on decode_ring.py's ring. It exists because TileLang's own
warp specialisation of a two-GEMM mma.sync tile hands a row stage back after the first GEMM, and the next rows then
overwrite it under the second (wrong results); here the consumers hand it back after both. A single GEMM splits each
stage's K over CHAINS accumulators. M is dynamic; N and K are fixed."""

import tilelang.language as T

from pegainfer.backends.tilelang.kernels.decode_ring import (BF16, PRODUCER, ROWS, Ring, allocator, multiplier,
                                                             producer, row_loader, starter)


def decode_tile(N: int, K: int, ACT: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int, MIN_BLOCKS: int,
                PDL: bool = False, PRE: int = 0, CHAINS: int = 1):
    assert K % BLOCK_K == 0, f"K={K} must be whole {BLOCK_K}-wide steps"
    ring = Ring(N, K, ACT, BLOCK_N, BLOCK_K, STAGES, THREADS, MIN_BLOCKS, CHAINS, PDL, PRE, rows=ROWS, swapped=False,
                steps=K // BLOCK_K, rows_first=PRE > 0)
    M = T.dynamic("M")
    issue_ahead, stream = producer(ring, row_loader(ring))
    multiply_all, start, alloc_stages = multiplier(ring), starter(ring), allocator(ring)

    @T.macro
    def store(C, acc, up, bx, by):
        # expf and an IEEE division, not gemm.py's approximate silu_times: at 16 rows the epilogue costs next to
        # nothing
        for i, j in T.Parallel(ROWS, BLOCK_N):
            if by * ROWS + i < M:
                if ACT:
                    C[by * ROWS + i, bx * BLOCK_N + j] = T.cast(acc[i, j] / (1.0 + T.exp(-acc[i, j])) * up[i, j], BF16)
                else:
                    C[by * ROWS + i, bx * BLOCK_N + j] = T.cast(acc[i, j], BF16)

    @T.macro
    def tile(A, W, C):
        with T.Kernel(N // BLOCK_N, T.ceildiv(M, ROWS), threads=THREADS + PRODUCER) as (bx, by):
            b = alloc_stages()
            start()
            if T.get_thread_binding() >= THREADS:
                issue_ahead(W, b, bx, 0)
                stream(A, None, W, b, b.a_full, bx, by, 0)
            else:
                multiply_all(b)
                store(C, b.acc, b.up, bx, by)

    w_rows = 2 * N if ACT else N

    @T.prim_func
    def decode_gemm(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16), C: T.Tensor((M, N), BF16)):
        tile(A, W, C)
    return decode_gemm
