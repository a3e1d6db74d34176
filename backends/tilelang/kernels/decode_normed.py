"""[x + x2 ->] RMSNorm -> the decode GEMM (or SiLU x up) for steps of up to 4 rows a CTA, the norm inside the tile:
a launch of its own would cost what the tile gains. The weight tile is mma.sync's A operand and a stage's 8 rows its
B: the step's 4 rows and X2's 4. As they land, a warpgroup of scalers after the producer sums them, writes the
residual sum to S (the first column tile), keeps each row's sum of squares and overwrites the stage with the sum
times G split into a bf16 high part (rows 0-3) and its remainder (rows 4-7), so that the producer's loads never wait
for a landing; the consumers add both halves' products and scale them by 1/rms, known only then. G, a weight like W,
is copied whole before the PDL wait; a norm that scales by offset + G (NORM_OFFSET) adds it in float32."""

import tilelang.language as T

from pegainfer.backends.tilelang.kernels.decode_ring import (BF16, CONSUMERS_BARRIER, PRODUCER, Ring, allocator,
                                                             multiplier, producer, starter)
from pegainfer.backends.tilelang.kernels.rows import norm_weight

SWAP_ROWS = 8  # a stage's rows: the step's 4 (and X2's), then the remainders
STEP_ROWS = SWAP_ROWS // 2  # the step's rows a CTA


def _row_loader(ring: Ring, ADD: bool):
    @T.macro
    def load_rows(A, X2, a_s, a_full, by, bz, k):
        """The step's 4 rows, then X2's 4 in the stage's second half; a_full: `landed`, which also waits for G
        (copied whole by the same threads before the first rows)."""
        stage, col = k % ring.STAGES, ring.column(bz, k)
        T.async_copy(A[by * STEP_ROWS:(by + 1) * STEP_ROWS, col:col + ring.BLOCK_K], a_s[stage, 0:STEP_ROWS, :])
        if ADD:
            T.async_copy(X2[by * STEP_ROWS:(by + 1) * STEP_ROWS, col:col + ring.BLOCK_K],
                         a_s[stage, STEP_ROWS:SWAP_ROWS, :])
        T.cp_async_barrier_noinc(a_full[stage])

    return load_rows


def _scalers(ring: Ring, ADD: bool, WRITE_SUM: bool, EPS: float, NORM_OFFSET: float, M):
    @T.macro
    def scale_rows(a_s, g_s, S, x, squares, landed, a_full, bx, by, k):
        """As step k's rows land: row r (+ X2's, in row r + 4) times G (+ NORM_OFFSET), split into a bf16 high
        part (row r) and the rest (row r + 4); the squares summed apart; the sum written to S by the first column
        tile."""
        stage = k % ring.STAGES
        T.mbarrier_wait_parity(landed[stage], (k // ring.STAGES) % 2)
        # every load first: in one loop, each waited for the last store
        for r, j in T.Parallel(STEP_ROWS, ring.BLOCK_K):
            x[r, j] = T.cast(a_s[stage, r, j], T.float32)
            if ADD:
                x[r, j] += T.cast(a_s[stage, r + STEP_ROWS, j], T.float32)
        for r, j in T.Parallel(STEP_ROWS, ring.BLOCK_K):
            squares[r, j] += x[r, j] * x[r, j]
            if WRITE_SUM:
                if bx == 0 and by * STEP_ROWS + r < M:
                    S[by * STEP_ROWS + r, ring.column(0, k) + j] = T.cast(x[r, j], BF16)
            x[r, j] = x[r, j] * norm_weight(T.cast(g_s[ring.column(0, k) + j], T.float32), NORM_OFFSET)
            a_s[stage, r, j] = T.cast(x[r, j], BF16)
            a_s[stage, r + STEP_ROWS, j] = T.cast(x[r, j] - T.cast(T.cast(x[r, j], BF16), T.float32), BF16)
        T.mbarrier_arrive(a_full[stage])  # each thread after its own stores: the phase completes after them all

    @T.macro
    def scale_all(a_s, g_s, S, x, squares, total, rstd, landed, a_full, rstd_full, bx, by):
        """The scalers: each step's rows scaled as they land, then each row's 1/rms."""
        T.clear(squares)
        for k in T.serial(ring.steps):
            scale_rows(a_s, g_s, S, x, squares, landed, a_full, bx, by, k)
        T.reduce_sum(squares, total, dim=1)
        for r in T.Parallel(STEP_ROWS):
            rstd[r] = T.rsqrt(total[r] / ring.K + EPS)
        T.mbarrier_arrive(rstd_full[0])

    return scale_all


def _epilogue(ring: Ring, M):
    @T.macro
    def store_normed(C, acc, up, sums, rstd, bx, by):
        """Each row's two products (rows r and r + 4) added, times the row's 1/rms (across threads: through shared
        memory), then the epilogue (expf and an IEEE division: see decode_tile.py's)."""
        T.copy(acc, sums[0, :, :])
        if ring.ACT:
            T.copy(up, sums[1, :, :])
        T.sync_threads(CONSUMERS_BARRIER, ring.THREADS)
        for i, r in T.Parallel(ring.BLOCK_N, STEP_ROWS):
            if by * STEP_ROWS + r < M:
                gate = (sums[0, i, r] + sums[0, i, r + STEP_ROWS]) * rstd[r]
                if ring.ACT:
                    value = (sums[1, i, r] + sums[1, i, r + STEP_ROWS]) * rstd[r]
                    C[by * STEP_ROWS + r, bx * ring.BLOCK_N + i] = T.cast(gate / (1.0 + T.exp(-gate)) * value,
                                                                          BF16)
                else:
                    C[by * STEP_ROWS + r, bx * ring.BLOCK_N + i] = T.cast(gate, BF16)

    return store_normed


def decode_normed(N: int, K: int, ACT: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int, MIN_BLOCKS: int,
                  ADD: bool, WRITE_SUM: bool, EPS: float, PDL: bool = False, PRE: int = 0, CHAINS: int = 1,
                  NORM_OFFSET: float = 0.0):
    assert K % BLOCK_K == 0, f"K={K} must be whole {BLOCK_K}-wide steps"
    assert ADD or not WRITE_SUM, "WRITE_SUM writes the sum of ADD's rows"
    ring = Ring(N, K, ACT, BLOCK_N, BLOCK_K, STAGES, THREADS, MIN_BLOCKS, CHAINS, PDL, PRE, rows=SWAP_ROWS,
                swapped=True, steps=K // BLOCK_K, rows_first=True)
    M = T.dynamic("M")
    multiply_all, start, alloc_stages = multiplier(ring), starter(ring), allocator(ring)
    issue_ahead, stream = producer(ring, _row_loader(ring, ADD))
    scale_all, store_normed = _scalers(ring, ADD, WRITE_SUM, EPS, NORM_OFFSET, M), _epilogue(ring, M)

    @T.macro
    def tile(A, X2, G, S, W, C):
        with T.Kernel(N // BLOCK_N, T.ceildiv(M, STEP_ROWS), threads=THREADS + 2 * PRODUCER) as (bx, by):
            b = alloc_stages()
            landed = T.alloc_barrier([PRODUCER] * STAGES)  # the rows land, the scalers scale them (a_full)
            g_s = T.alloc_shared((K,), BF16)
            x = T.alloc_fragment((STEP_ROWS, BLOCK_K), T.float32)
            squares = T.alloc_fragment((STEP_ROWS, BLOCK_K), T.float32)
            total = T.alloc_fragment((STEP_ROWS,), T.float32)
            # rstd and sums in static shared memory, which holds the barriers and is padded to 1 KB anyway: off the
            # dynamic allocation, so that more stages fit the CTAs an SM holds
            rstd = T.alloc_shared((STEP_ROWS,), T.float32, scope="shared")
            rstd_full = T.alloc_barrier([PRODUCER])
            sums = T.alloc_shared((2 if ACT else 1, BLOCK_N, SWAP_ROWS), T.float32, scope="shared")
            start()
            if T.get_thread_binding() >= THREADS + PRODUCER:
                scale_all(b.a_s, g_s, S, x, squares, total, rstd, landed, b.a_full, rstd_full, bx, by)
            elif T.get_thread_binding() >= THREADS:
                issue_ahead(W, b, bx, 0)
                T.async_copy(G[0:K], g_s)  # a weight: before the wait, ahead of the first rows `landed` waits for
                stream(A, X2, W, b, landed, bx, by, 0)
            else:
                multiply_all(b)
                T.mbarrier_wait_parity(rstd_full[0], 0)
                store_normed(C, b.acc, b.up, sums, rstd, bx, by)

    w_rows = 2 * N if ACT else N
    if WRITE_SUM:
        @T.prim_func
        def decode_gemm_add_norm_sum(A: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                                     S: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16),
                                     C: T.Tensor((M, N), BF16)):
            tile(A, X2, G, S, W, C)
        return decode_gemm_add_norm_sum
    if ADD:
        @T.prim_func
        def decode_gemm_add_norm(A: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                                 W: T.Tensor((w_rows, K), BF16), C: T.Tensor((M, N), BF16)):
            tile(A, X2, G, None, W, C)
        return decode_gemm_add_norm

    @T.prim_func
    def decode_gemm_norm(A: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16), W: T.Tensor((w_rows, K), BF16),
                         C: T.Tensor((M, N), BF16)):
        tile(A, None, G, None, W, C)
    return decode_gemm_norm
