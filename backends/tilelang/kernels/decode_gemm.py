"""SiLU(x @ Wg^T) * (x @ Wu^T) over a merged [2N, K] weight for decode steps of up to 16 rows, warp-specialised by
hand. TileLang's own warp specialisation of gemm.py's tile, with two GEMMs reading one activation stage on
mma.sync, released that stage to the producer after the first GEMM, so the next rows could land while the second
still read them (wrong results on the H200, docs/BENCHMARKS.md session 6); here the consumers release a stage once
both GEMMs are done. A producer warpgroup issues the TMA loads of the first STAGES weight tiles, then feeds the
step's rows by predicated cp.async (rows past M zero-filled, never read) and the remaining weight tiles as stages
free up; the consumers run mma.sync on 16-row tiles and the epilogue. M is dynamic; N and K are fixed. (A single
GEMM written this way measured 5-10% slower than gemm.py's tile, which the plan keeps for it.)"""

import tilelang.language as T

BF16 = T.bfloat16
ROWS = 16  # mma.sync's M
PRODUCER = 128  # the producer warpgroup's threads, after the THREADS consumers


def decode_gemm(N: int, K: int, ACT: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int, MIN_BLOCKS: int):
    assert ACT == 1, f"decode_gemm computes SiLU(gate) * up (ACT=1), got ACT={ACT}: single GEMMs take gemm.py's tile"
    M = T.dynamic("M")
    steps = K // BLOCK_K
    ahead = min(STAGES, steps)  # weight tiles issued before the first rows

    @T.macro
    def load_weights(W, w_s, u_s, w_full, bx, k):
        stage = k % STAGES
        T.tma_copy(W[bx * BLOCK_N:(bx + 1) * BLOCK_N, k * BLOCK_K:(k + 1) * BLOCK_K], w_s[stage, :, :],
                   barrier=w_full[stage])
        T.tma_copy(W[N + bx * BLOCK_N:N + (bx + 1) * BLOCK_N, k * BLOCK_K:(k + 1) * BLOCK_K], u_s[stage, :, :],
                   barrier=w_full[stage])
        T.mbarrier_arrive(w_full[stage])

    @T.macro
    def load_rows(A, a_s, a_full, by, k):
        stage = k % STAGES
        T.async_copy(A[by * ROWS:(by + 1) * ROWS, k * BLOCK_K:(k + 1) * BLOCK_K], a_s[stage, :, :])
        T.cp_async_barrier_noinc(a_full[stage])

    @T.prim_func
    def decode_gemm(A: T.Tensor((M, K), BF16), W: T.Tensor((2 * N, K), BF16), C: T.Tensor((M, N), BF16)):
        with T.Kernel(N // BLOCK_N, T.ceildiv(M, ROWS), threads=THREADS + PRODUCER) as (bx, by):
            a_s = T.alloc_shared((STAGES, ROWS, BLOCK_K), BF16)
            w_s = T.alloc_shared((STAGES, BLOCK_N, BLOCK_K), BF16)
            u_s = T.alloc_shared((STAGES, BLOCK_N, BLOCK_K), BF16)
            w_full = T.alloc_barrier([PRODUCER] * STAGES)
            a_full = T.alloc_barrier([PRODUCER] * STAGES)
            empty = T.alloc_barrier([THREADS] * STAGES)
            acc = T.alloc_fragment((ROWS, BLOCK_N), T.float32)
            up = T.alloc_fragment((ROWS, BLOCK_N), T.float32)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            T.disable_warp_group_reg_alloc()
            if T.get_thread_binding() >= THREADS:
                for k in T.serial(ahead):
                    load_weights(W, w_s, u_s, w_full, bx, k)
                for k in T.serial(steps):
                    if k >= STAGES:
                        T.mbarrier_wait_parity(empty[k % STAGES], (k // STAGES + 1) % 2)
                        load_weights(W, w_s, u_s, w_full, bx, k)
                    load_rows(A, a_s, a_full, by, k)
            else:
                T.clear(acc)
                T.clear(up)
                for k in T.serial(steps):
                    T.mbarrier_wait_parity(w_full[k % STAGES], (k // STAGES) % 2)
                    T.mbarrier_wait_parity(a_full[k % STAGES], (k // STAGES) % 2)
                    T.gemm(a_s[k % STAGES, :, :], w_s[k % STAGES, :, :], acc, transpose_B=True)
                    T.gemm(a_s[k % STAGES, :, :], u_s[k % STAGES, :, :], up, transpose_B=True)
                    T.mbarrier_arrive(empty[k % STAGES])  # after both GEMMs: they read the same rows
                # expf and an IEEE division, not gemm.py's silu_times: the cache keys a launch by its own template's
                # text, so an import from gemm.py could change this kernel without rebuilding it (and 16 rows make
                # the epilogue's cost negligible, where it was 7-9% of a 128x256 prefill tile)
                for i, j in T.Parallel(ROWS, BLOCK_N):
                    if by * ROWS + i < M:
                        C[by * ROWS + i, bx * BLOCK_N + j] = T.cast(acc[i, j] / (1.0 + T.exp(-acc[i, j])) * up[i, j],
                                                                    BF16)

    return decode_gemm
