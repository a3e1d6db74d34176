"""y = x @ W^T, or SiLU(x @ Wg^T) * (x @ Wu^T) over a merged [2N, K] weight (ACT=1), for decode steps of up to 16
rows, warp-specialised by hand. TileLang's own warp specialisation of gemm.py's tile, with two GEMMs reading one
activation stage on mma.sync, released that stage to the producer after the first GEMM, so the next rows could land
while the second still read them (wrong results on the H200, docs/BENCHMARKS.md session 6); here the consumers
release a stage once its GEMMs are done. A producer warpgroup issues the TMA loads of the first STAGES weight tiles,
then feeds the step's rows by predicated cp.async (rows past M zero-filled, never read) and the remaining weight
tiles as stages free up; the consumers run mma.sync on 16-row tiles and the epilogue. M is dynamic; N and K are
fixed. The plan serves SiLU x up at 4 and 16 rows with it; its single-GEMM, PDL, SPLIT and SWAP_ROWS forms are the
decode cases of scripts/gpu/gemm_probe.py, which measured them no faster in a decode step (docs/BENCHMARKS.md,
session 8).

PDL (programmatic dependent launch): every CTA lets the next kernel launch at once, and the producer issues its
first STAGES weight tiles before it waits for the previous kernel (weights never depend on it), so a chain of
decode GEMMs keeps the weights streaming across the launch boundary. Only the producer reads what the previous
kernel wrote (the rows); the consumers write only after rows that came after that wait.

SPLIT > 1 (a single GEMM of at most 16 rows): the CTAs of an output tile share its K range, so that a narrow N
(2560 columns make 80-160 tiles) still spreads over every SM. Each writes its fp32 sums to its plane of P and takes
a ticket; the last of a tile adds the planes in plane order (the same sum whichever CTA is last), writes C and
resets the tile's ticket to zero for the next launch (the runtime zeroes the tickets once).

SWAP_ROWS (8 or 16; a single unsplit GEMM): the weight tile is mma.sync's A operand (BLOCK_N = 16 weight rows) and
the step's rows its B operand, so a stage holds SWAP_ROWS rows where the A operand needs 16, and the freed shared
memory holds more weight stages."""

import tilelang.language as T

BF16 = T.bfloat16
ROWS = 16  # mma.sync's M
PRODUCER = 128  # the producer warpgroup's threads, after the THREADS consumers
CONSUMERS_BARRIER = 1  # a named barrier of the consumers alone (0 is the whole CTA's)


def decode_gemm(N: int, K: int, ACT: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int, MIN_BLOCKS: int,
                PDL: bool = False, SPLIT: int = 1, SWAP_ROWS: int = 0):
    assert K % (BLOCK_K * SPLIT) == 0, f"K={K} must split into {SPLIT} ranges of whole {BLOCK_K}-wide steps"
    assert SPLIT == 1 or not ACT, "a split tile sums one GEMM (SiLU x up needs both sums whole)"
    assert not SWAP_ROWS or (not ACT and SPLIT == 1), "a swapped tile computes one unsplit GEMM"
    rows = SWAP_ROWS or ROWS  # rows a tile; SWAP_ROWS: the weight tile is mma's A operand and the rows its B
    M = T.dynamic("M")
    steps = K // BLOCK_K // SPLIT  # of one CTA
    ahead = min(STAGES, steps)  # weight tiles issued before the first rows
    w_rows = 2 * N if ACT else N

    def column(bz, k):
        """The first column of a CTA's k-th step (bz: its K range, when split)."""
        return (bz * steps + k) * BLOCK_K

    @T.macro
    def load_weights(W, w_s, u_s, w_full, bx, bz, k):
        stage, col = k % STAGES, column(bz, k)
        T.tma_copy(W[bx * BLOCK_N:(bx + 1) * BLOCK_N, col:col + BLOCK_K], w_s[stage, :, :], barrier=w_full[stage])
        if ACT:
            T.tma_copy(W[N + bx * BLOCK_N:N + (bx + 1) * BLOCK_N, col:col + BLOCK_K], u_s[stage, :, :],
                       barrier=w_full[stage])
        T.mbarrier_arrive(w_full[stage])

    @T.macro
    def load_rows(A, a_s, a_full, by, bz, k):
        stage, col = k % STAGES, column(bz, k)
        T.async_copy(A[by * rows:(by + 1) * rows, col:col + BLOCK_K], a_s[stage, :, :])
        T.cp_async_barrier_noinc(a_full[stage])

    @T.macro
    def store(C, acc, up, bx, by):
        # expf and an IEEE division, not gemm.py's silu_times: the cache keys a launch by its own template's text, so
        # an import from gemm.py could change this kernel without rebuilding it (and 16 rows make the epilogue's cost
        # negligible, where it was 7-9% of a 128x256 prefill tile)
        for i, j in T.Parallel(ROWS, BLOCK_N):
            if by * ROWS + i < M:
                if ACT:
                    C[by * ROWS + i, bx * BLOCK_N + j] = T.cast(acc[i, j] / (1.0 + T.exp(-acc[i, j])) * up[i, j], BF16)
                else:
                    C[by * ROWS + i, bx * BLOCK_N + j] = T.cast(acc[i, j], BF16)

    @T.macro
    def store_swapped(C, acc, bx, by):
        for i, r in T.Parallel(BLOCK_N, rows):
            if by * rows + r < M:
                C[by * rows + r, bx * BLOCK_N + i] = T.cast(acc[i, r], BF16)

    @T.macro
    def meet_split(C, P, tickets, acc, ticket, bx, bz):
        """The split epilogue (M <= 16, so by is 0): this CTA's plane, its ticket, and the sum if it is last."""
        for i, j in T.Parallel(ROWS, BLOCK_N):
            P[bz * ROWS + i, bx * BLOCK_N + j] = acc[i, j]
        T.call_extern("handle", "__threadfence")
        T.sync_threads(CONSUMERS_BARRIER, THREADS)
        if T.get_thread_binding() == 0:
            ticket[0] = T.atomic_add(tickets[bx], 1, return_prev=True)
        T.sync_threads(CONSUMERS_BARRIER, THREADS)
        if ticket[0] == SPLIT - 1:
            T.call_extern("handle", "__threadfence")
            T.clear(acc)
            for s in T.serial(SPLIT):  # past L1 (.cg): the other planes were written by other SMs
                for i, j in T.Parallel(ROWS, BLOCK_N):
                    acc[i, j] += T.call_extern("float32", "__ldcg", T.address_of(P[s * ROWS + i, bx * BLOCK_N + j]))
            store(C, acc, None, bx, 0)
            if T.get_thread_binding() == 0:
                tickets[bx] = 0

    @T.macro
    def tile(A, W, C, P, tickets):
        with T.Kernel(N // BLOCK_N, T.ceildiv(M, rows), SPLIT, threads=THREADS + PRODUCER) as (bx, by, bz):
            a_s = T.alloc_shared((STAGES, rows, BLOCK_K), BF16)
            w_s = T.alloc_shared((STAGES, BLOCK_N, BLOCK_K), BF16)
            u_s = None  # ACT=0: no up half
            if ACT:
                u_s = T.alloc_shared((STAGES, BLOCK_N, BLOCK_K), BF16)
            w_full = T.alloc_barrier([PRODUCER] * STAGES)
            a_full = T.alloc_barrier([PRODUCER] * STAGES)
            empty = T.alloc_barrier([THREADS] * STAGES)
            acc = T.alloc_fragment((BLOCK_N, rows) if SWAP_ROWS else (ROWS, BLOCK_N), T.float32)
            up = None
            if ACT:
                up = T.alloc_fragment((ROWS, BLOCK_N), T.float32)
            ticket = None
            if SPLIT > 1:
                ticket = T.alloc_shared((1,), T.int32)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            T.disable_warp_group_reg_alloc()
            if PDL:
                T.pdl_trigger()
            if T.get_thread_binding() >= THREADS:
                for k in T.serial(ahead):
                    load_weights(W, w_s, u_s, w_full, bx, bz, k)
                if PDL:
                    T.pdl_sync()
                for k in T.serial(steps):
                    if k >= STAGES:
                        T.mbarrier_wait_parity(empty[k % STAGES], (k // STAGES + 1) % 2)
                        load_weights(W, w_s, u_s, w_full, bx, bz, k)
                    load_rows(A, a_s, a_full, by, bz, k)
            else:
                T.clear(acc)
                if ACT:
                    T.clear(up)
                for k in T.serial(steps):
                    T.mbarrier_wait_parity(w_full[k % STAGES], (k // STAGES) % 2)
                    T.mbarrier_wait_parity(a_full[k % STAGES], (k // STAGES) % 2)
                    if SWAP_ROWS:
                        T.gemm(w_s[k % STAGES, :, :], a_s[k % STAGES, :, :], acc, transpose_B=True)
                    else:
                        T.gemm(a_s[k % STAGES, :, :], w_s[k % STAGES, :, :], acc, transpose_B=True)
                    if ACT:
                        T.gemm(a_s[k % STAGES, :, :], u_s[k % STAGES, :, :], up, transpose_B=True)
                    T.mbarrier_arrive(empty[k % STAGES])  # after the GEMMs: both read the same rows
                if SPLIT > 1:
                    meet_split(C, P, tickets, acc, ticket, bx, bz)
                elif SWAP_ROWS:
                    store_swapped(C, acc, bx, by)
                else:
                    store(C, acc, up, bx, by)

    if SPLIT > 1:
        @T.prim_func
        def decode_gemm_split(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16), C: T.Tensor((M, N), BF16),
                              P: T.Tensor((SPLIT * ROWS, N), T.float32), tickets: T.Tensor((N // BLOCK_N,), T.int32)):
            tile(A, W, C, P, tickets)
        return decode_gemm_split

    @T.prim_func
    def decode_gemm(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16), C: T.Tensor((M, N), BF16)):
        tile(A, W, C, None, None)
    return decode_gemm
