"""y = x @ W^T for decode steps of up to 4 rows a CTA, where the columns are too few to spread 16-row weight tiles
over every SM: a CTA streams BLOCK_N / 2 weight rows over the whole K. W is read as [2N, K/2] (the same memory: row
2i + h is weight row i's half h), so that a TMA box of BLOCK_N rows, mma.sync's A operand, holds BLOCK_N / 2 weight
rows' two K halves; the B operand's 8 rows are the step's 4 over both halves (rows 0-3 their first halves, 4-7 their
second). Of the products, (2i, r) and (2i + 1, r + 4) pair like halves; the epilogue adds them, the rest go unused.
No split over K, so no sum across CTAs."""

import tilelang.language as T

from pegainfer.backends.tilelang.kernels.decode_ring import (BF16, CONSUMERS_BARRIER, PRODUCER, Ring, allocator,
                                                             multiplier, producer, starter)

SWAP_ROWS = 8  # a stage's rows: the step's 4 over both K halves


def decode_halved(N: int, K: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int, MIN_BLOCKS: int,
                  PDL: bool = False, PRE: int = 0, CHAINS: int = 1):
    assert BLOCK_N % 2 == 0 and N % (BLOCK_N // 2) == 0, f"BLOCK_N={BLOCK_N}: whole weight rows over both K " \
        f"halves, a whole number of them in N={N}"
    assert K % (2 * BLOCK_K) == 0, f"K={K} must split into two halves of whole {BLOCK_K}-wide steps"
    rows, step_rows, out_n, half = SWAP_ROWS, SWAP_ROWS // 2, BLOCK_N // 2, K // 2
    ring = Ring(N, K, 0, BLOCK_N, BLOCK_K, STAGES, THREADS, MIN_BLOCKS, CHAINS, PDL, PRE, rows=rows,
                swapped=True, steps=half // BLOCK_K, rows_first=PRE > 0)
    M = T.dynamic("M")
    multiply_all, start, alloc_stages = multiplier(ring), starter(ring), allocator(ring)

    @T.macro
    def load_rows(A, X2, a_s, a_full, by, bz, k):
        """The step's 4 rows over both K halves, as the weights."""
        stage, col = k % STAGES, ring.column(bz, k)
        T.async_copy(A[by * step_rows:(by + 1) * step_rows, col:col + BLOCK_K], a_s[stage, 0:step_rows, :])
        T.async_copy(A[by * step_rows:(by + 1) * step_rows, half + col:half + col + BLOCK_K],
                     a_s[stage, step_rows:rows, :])
        T.cp_async_barrier_noinc(a_full[stage])

    issue_ahead, stream = producer(ring, load_rows)

    @T.macro
    def store_halves(C, acc, sums, bx, by):
        """Output (r, i): weight row i's first K half times row r's plus its second times row r's second, products
        (2i, r) and (2i + 1, r + 4) of the tile, added across threads through shared memory."""
        T.copy(acc, sums[0, :, :])
        T.sync_threads(CONSUMERS_BARRIER, THREADS)
        for i, r in T.Parallel(out_n, step_rows):
            if by * step_rows + r < M:
                C[by * step_rows + r, bx * out_n + i] = T.cast(sums[0, 2 * i, r] + sums[0, 2 * i + 1, r + step_rows],
                                                               BF16)

    @T.macro
    def tile(A, W, C):
        with T.Kernel(N // out_n, T.ceildiv(M, step_rows), threads=THREADS + PRODUCER) as (bx, by):
            b = alloc_stages()
            sums = T.alloc_shared((1, BLOCK_N, rows), T.float32, scope="shared")  # the epilogue's pairs
            start()
            if T.get_thread_binding() >= THREADS:
                issue_ahead(W, b, bx, 0)
                stream(A, None, W, b, b.a_full, bx, by, 0)
            else:
                multiply_all(b)
                store_halves(C, b.acc, sums, bx, by)

    @T.prim_func
    def decode_gemm(A: T.Tensor((M, K), BF16), W: T.Tensor((2 * N, half), BF16), C: T.Tensor((M, N), BF16)):
        tile(A, W, C)
    return decode_gemm
