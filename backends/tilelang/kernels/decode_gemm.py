"""y = x @ W^T, or SiLU(x @ Wg^T) * (x @ Wu^T) over a merged [2N, K] weight (ACT=1), for decode steps of up to 16
rows, warp-specialised by hand. TileLang's own warp specialisation of gemm.py's tile, with two GEMMs reading one
activation stage on mma.sync, released that stage to the producer after the first GEMM, so the next rows could land
while the second still read them (wrong results on the H200, docs/BENCHMARKS.md session 6); here the consumers
release a stage once its GEMMs are done. A producer warpgroup issues the TMA loads of the first STAGES weight tiles,
then feeds the step's rows by predicated cp.async (rows past M zero-filled, never read) and the remaining weight
tiles as stages free up; the consumers run mma.sync on 16-row tiles and the epilogue. M is dynamic; N and K are
fixed. The plan serves every GEMM's steps of up to 16 rows with it (decode_16x16; single GEMMs in CHAINS, below), the
steps of up to 4 rows of the GEMMs with an RMSNorm prologue with its NORM form, those of one row and of up to 4 of the
single GEMMs with its SWAP_ROWS form in four chains over both K halves (HALVES, session 14), and those of up to 16 rows
of a single GEMM whose output the next kernel's norm launch adds with its PARTIAL form (session 16). The SPLIT forms
summed in the kernel, through global memory or over a cluster (CLUSTER, the plan's 4-row tile in sessions 12 and 13),
are decode cases of scripts/gpu/gemm_probe.py: no faster than HALVES (docs/BENCHMARKS.md, sessions 8, 11, 12, 14, 16).

CHAINS = 2 or 4 (a single GEMM): each stage's K halves (quarters) go to as many accumulators, summed before the
epilogue, so a consumer warp runs independent chains of mma.sync; with one, each mma waited on the previous one's
result and a CTA streamed near 16 GB/s (the swapped tiles, one consumer warp, gained 10-20% with two, a little more
with four: docs/BENCHMARKS.md, sessions 10 and 11).

PDL (programmatic dependent launch): every CTA lets the next kernel launch at once, and the producer issues its
first STAGES (PRE) weight tiles (and a normed tile's G) before it waits for the previous kernel (weights never
depend on it: the planner takes only parameters), so a chain of decode GEMMs keeps the weights streaming across the
launch boundary. Only the producer reads what the previous kernel wrote (the rows); the consumers and a normed
tile's scalers write only after rows that came after that wait.

SPLIT > 1 (a single GEMM of at most 16 rows): the CTAs of an output tile share its K range, so that a narrow N
(2560 columns make 80-160 tiles) still spreads over every SM. Each writes its fp32 sums to its plane of P (16 rows:
a swapped tile of 8 rows a CTA fills half of it) and takes its tile's ticket; the last of a tile adds the planes in
plane order (the same sum whichever CTA is last), writes C and resets the ticket to zero for the next launch (the
runtime zeroes the tickets once).

PARTIAL (SPLIT > 1, no CLUSTER): the planes are the output; no fence, ticket or sum in the kernel. The kernel after it
adds them where it reads this GEMM's output as its add's second operand (rows.py's add_rms_norm with PLANES); where no
kernel does, the runtime runs rows.py's sum_planes first. Summed in the kernel, by ticket or over a cluster, the wide
split tiles lost 3 us of o_proj's 6 at 16 rows; with the planes alone, 32 weight rows a CTA over a quarter of K (a
16-row stage two thirds weights, o_proj's 320 CTAs) took o_proj to 5.8 us and down to 13.4 (docs/BENCHMARKS.md,
session 16).

CLUSTER (SPLIT > 1): the SPLIT CTAs of an output tile form a thread block cluster, and instead of planes and tickets
in global memory the others store their sums into the first one's shared memory (st.shared::cluster) before one
cluster barrier; the first adds them in rank order and writes C. No global round trip, no ticket to reset. TileLang
leaves the cluster to the launch: launched without it, each CTA would be a cluster of one and store into its own
shared memory, so the epilogue traps unless the cluster holds SPLIT CTAs.

SWAP_ROWS (8 or 16): the weight tile (or each of gate's and up's) is mma.sync's A operand (BLOCK_N = 16
weight rows) and the step's rows its B operand, so a stage holds SWAP_ROWS rows where the A operand needs 16, and the
freed shared memory holds more weight stages.

HALVES (SWAP_ROWS = 8, a single GEMM, unsplit): the A operand's 16 rows are 8 weight rows over both K halves (W read
as [2N, K/2], the same memory: row 2i + h is weight row i's half h) and the B operand's 8 are 4 of the step's rows
over both halves (rows 0-3 their first halves, 4-7 their second), so that a CTA streams 8 weight rows over the whole
K: o_proj's 2560 columns make 320 CTAs of 8 steps with no split to sum across CTAs, as N = 5120, K = 2048 does
(88% of the copy bandwidth, where the same 320 CTAs as a cluster-split o_proj reached 78-81%, session 14). Of the
products, (2i, r) and (2i + 1, r + 4) pair like halves; the epilogue adds them, the rest go unused.

NORM (SWAP_ROWS = 8, at most 4 rows a CTA): the [add +] RMSNorm prologue in the tile, where a launch of its own cost
what the tile gained (2.8 us, session 8). A stage holds the step's 4 rows and X2's 4 (ADD); as they land, a second
warpgroup after the producer (the scalers) sums them, writes the residual sum to S (the first column tile), keeps each
row's sum of squares, and overwrites the stage with the sum times G split into a bf16 high part (rows 0-3) and its
remainder (rows 4-7), so that the producer's loads never wait for a landing. The products of both halves are added in
the epilogue and scaled by 1/rms, known only then: the normed row reaches the GEMM to 16 bits, not rounded to bf16
before the scale as the norm launch rounds it. G, a weight like W, is copied whole before the PDL wait, ahead of the
first rows (QKV 8.4-8.6 us against 9.0-9.3 with a slice of G loaded beside each step's rows, session 13). PRE: weight
stages issued before the previous kernel's end (PDL); a step's rows then go out before its weights, since rows requested
behind a full SM's worth of weight loads waited several steps for them (the decode step at one row: 2.60 ms with PRE = 1
against 2.78-2.84 with every stage ahead, docs/BENCHMARKS.md session 9). Without NORM, PRE likewise sends each step's
rows before the weight stages not issued ahead (no faster for the single GEMMs, session 11; for o_proj's halved tile of
8 steps, 4 ahead of 6 stages, 5.5-5.7 us against 5.8-5.9, session 14; for QKV's 16x16 tile, 2 ahead of 4 stages, 8.4-8.6
us at 16 rows against 8.9, session 17). The producer once scaled the rows itself, two
steps after loading them: no faster for QKV, 3% slower for SiLU x up (session 11), and no faster than the scalers once G
came whole (QKV 9.2-9.4 us against 9.1-9.2 at the same PRE, session 13)."""

import tilelang.language as T

# CLUSTER: a CTA's store into the shared memory of another of its cluster, at the same offset as `local` in its own;
# and a trap unless the launch made a cluster of `expected` CTAs
PEER_STORE = """
__device__ __forceinline__ void require_cluster(int expected) {
  unsigned ctas;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(ctas));
  if (ctas != static_cast<unsigned>(expected)) __trap();
}

__device__ __forceinline__ void store_peer(float* local, float value, int rank) {
  unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(local)), remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(value) : "memory");
}
"""

BF16 = T.bfloat16
ROWS = 16  # mma.sync's M
PRODUCER = 128  # the producer warpgroup's threads, after the THREADS consumers
CONSUMERS_BARRIER = 1  # a named barrier of the consumers alone (0 is the whole CTA's)


def decode_gemm(N: int, K: int, ACT: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int, MIN_BLOCKS: int,
                PDL: bool = False, SPLIT: int = 1, SWAP_ROWS: int = 0, NORM: bool = False, ADD: bool = False,
                WRITE_SUM: bool = False, EPS: float = 1e-6, PRE: int = 0, CHAINS: int = 1, CLUSTER: bool = False,
                HALVES: bool = False, PARTIAL: bool = False):
    assert K % (BLOCK_K * SPLIT) == 0, f"K={K} must split into {SPLIT} ranges of whole {BLOCK_K}-wide steps"
    assert SPLIT == 1 or not ACT, "a split tile sums one GEMM (SiLU x up needs both sums whole)"
    assert not NORM or SPLIT == 1, "a normed tile is not split"
    assert SPLIT == 1 or SWAP_ROWS <= ROWS, f"a split tile's row tiles share a plane of {ROWS} rows, got {SWAP_ROWS}"
    assert not NORM or SWAP_ROWS == 8, f"a normed tile is a swapped one of 8 rows (4 and their pairs), got {SWAP_ROWS}"
    assert NORM or not ADD, "ADD sums the rows of a norm prologue: a tile without NORM has none"
    assert ADD or not WRITE_SUM, "WRITE_SUM writes the sum of ADD's rows"
    assert not CLUSTER or 1 < SPLIT <= 8, f"CLUSTER sums a split tile's parts in a portable cluster: SPLIT 2..8, got " \
        f"{SPLIT}"
    assert not PARTIAL or (SPLIT > 1 and not CLUSTER), f"PARTIAL leaves a split tile's planes to the next kernel: " \
        f"SPLIT > 1 without CLUSTER, got SPLIT={SPLIT}, CLUSTER={CLUSTER}"
    assert PRE <= STAGES, f"PRE: weight stages issued before the rows (the PDL wait), at most {STAGES}, got {PRE}"
    assert CHAINS in (1, 2, 4) and (CHAINS == 1 or not ACT), f"CHAINS splits a single GEMM's stages in 1, 2 or 4 " \
        f"(SiLU x up has two GEMMs already), got {CHAINS} with ACT={ACT}"
    assert not HALVES or (SWAP_ROWS == 8 and SPLIT == 1 and not (NORM or ACT)), "HALVES stacks a single GEMM's " \
        f"two K halves in a swapped tile of 8 rows, unsplit: got SWAP_ROWS={SWAP_ROWS}, SPLIT={SPLIT}, NORM={NORM}, " \
        f"ACT={ACT}"
    assert not HALVES or K % (2 * BLOCK_K) == 0, f"HALVES: K={K} must split into two halves of whole {BLOCK_K}-wide " \
        "steps"
    rows = SWAP_ROWS or ROWS  # mma rows a tile; SWAP_ROWS: the weight tile is mma's A operand and the rows its B
    # the step's rows a tile covers: NORM's and HALVES' B holds 4 of them and a second part of each (below)
    step_rows = rows // 2 if NORM or HALVES else rows
    out_n = BLOCK_N // 2 if HALVES else BLOCK_N  # output columns a tile (HALVES: 8 weight rows, both K halves)
    half = K // 2 if HALVES else 0  # HALVES: where the second K half begins
    sums_shape = (BLOCK_N, rows) if SWAP_ROWS else (ROWS, BLOCK_N)  # an accumulator's: acc, up and CHAINS' others
    M = T.dynamic("M")
    steps = (K // 2 if HALVES else K) // BLOCK_K // SPLIT  # of one CTA
    ahead = min(PRE or STAGES, steps)  # weight tiles issued before the first rows
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
    def load_rows(A, X2, a_s, a_full, by, bz, k):
        """The step's rows by predicated cp.async (rows past M zero-filled); a_full: NORM's `landed`, which also
        waits for G (copied whole by the same threads before the first rows)."""
        stage, col = k % STAGES, column(bz, k)
        if NORM:  # the step's 4 rows, then X2's 4 in the stage's second half
            T.async_copy(A[by * step_rows:(by + 1) * step_rows, col:col + BLOCK_K], a_s[stage, 0:step_rows, :])
            if ADD:
                T.async_copy(X2[by * step_rows:(by + 1) * step_rows, col:col + BLOCK_K],
                             a_s[stage, step_rows:rows, :])
        elif HALVES:  # the step's 4 rows over both K halves, as the weights
            T.async_copy(A[by * step_rows:(by + 1) * step_rows, col:col + BLOCK_K], a_s[stage, 0:step_rows, :])
            T.async_copy(A[by * step_rows:(by + 1) * step_rows, half + col:half + col + BLOCK_K],
                         a_s[stage, step_rows:rows, :])
        else:
            T.async_copy(A[by * rows:(by + 1) * rows, col:col + BLOCK_K], a_s[stage, :, :])
        T.cp_async_barrier_noinc(a_full[stage])  # arrives once all this thread's copies so far have landed

    @T.macro
    def scale_rows(a_s, g_s, S, x, squares, landed, a_full, bx, by, k):
        """NORM, by the scalers as step k's rows land: row r (+ X2's, in row r + 4) times G, split into a bf16 high
        part (row r) and the rest (row r + 4); the squares summed apart; the sum written to S by the first column
        tile."""
        stage = k % STAGES
        T.mbarrier_wait_parity(landed[stage], (k // STAGES) % 2)
        for r, j in T.Parallel(step_rows, BLOCK_K):  # every load first: in one loop, each waited for the last store
            x[r, j] = T.cast(a_s[stage, r, j], T.float32)
            if ADD:
                x[r, j] += T.cast(a_s[stage, r + step_rows, j], T.float32)
        for r, j in T.Parallel(step_rows, BLOCK_K):
            squares[r, j] += x[r, j] * x[r, j]
            if WRITE_SUM:
                if bx == 0 and by * step_rows + r < M:
                    S[by * step_rows + r, column(0, k) + j] = T.cast(x[r, j], BF16)
            x[r, j] = x[r, j] * T.cast(g_s[column(0, k) + j], T.float32)
            a_s[stage, r, j] = T.cast(x[r, j], BF16)
            a_s[stage, r + step_rows, j] = T.cast(x[r, j] - T.cast(T.cast(x[r, j], BF16), T.float32), BF16)
        T.mbarrier_arrive(a_full[stage])  # each thread after its own stores: the phase completes after them all

    @T.macro
    def inverse_rms(squares, total, rstd, rstd_full):
        """The scalers' last step: each row's 1/rms."""
        T.reduce_sum(squares, total, dim=1)
        for r in T.Parallel(step_rows):
            rstd[r] = T.rsqrt(total[r] / K + EPS)
        T.mbarrier_arrive(rstd_full[0])

    @T.macro
    def multiply_part(a_s, w_s, sums, stage, part):
        """The stage's part-th K slice (of CHAINS) of rows times weights into `sums`: with CHAINS > 1, one of as many
        independent chains of mma.sync, where one chain's latency set the pace (a consumer warp waits on each mma's
        result before the next: one chain of 16 k-steps a stage held a CTA to about 16 GB/s, session 10)."""
        lo, hi = part * BLOCK_K // CHAINS, (part + 1) * BLOCK_K // CHAINS
        if SWAP_ROWS:
            T.gemm(w_s[stage, :, lo:hi], a_s[stage, :, lo:hi], sums, transpose_B=True)
        else:
            T.gemm(a_s[stage, :, lo:hi], w_s[stage, :, lo:hi], sums, transpose_B=True)

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
    def store_swapped(C, acc, up, bx, by):
        for i, r in T.Parallel(BLOCK_N, rows):
            if by * rows + r < M:
                if ACT:
                    C[by * rows + r, bx * BLOCK_N + i] = T.cast(acc[i, r] / (1.0 + T.exp(-acc[i, r])) * up[i, r], BF16)
                else:
                    C[by * rows + r, bx * BLOCK_N + i] = T.cast(acc[i, r], BF16)

    @T.macro
    def store_normed(C, acc, up, sums, rstd, bx, by):
        """NORM: each row's two products (rows r and r + 4) added, times the row's 1/rms (across threads: through
        shared memory), then the epilogue."""
        T.copy(acc, sums[0, :, :])
        if ACT:
            T.copy(up, sums[1, :, :])
        T.sync_threads(CONSUMERS_BARRIER, THREADS)
        for i, r in T.Parallel(BLOCK_N, step_rows):
            if by * step_rows + r < M:
                gate = (sums[0, i, r] + sums[0, i, r + step_rows]) * rstd[r]
                if ACT:
                    value = (sums[1, i, r] + sums[1, i, r + step_rows]) * rstd[r]
                    C[by * step_rows + r, bx * BLOCK_N + i] = T.cast(gate / (1.0 + T.exp(-gate)) * value, BF16)
                else:
                    C[by * step_rows + r, bx * BLOCK_N + i] = T.cast(gate, BF16)

    @T.macro
    def store_halves(C, acc, sums, bx, by):
        """HALVES: output (r, i) is weight row i's first K half times row r's plus its second times row r's second:
        products (2i, r) and (2i + 1, r + 4) of the tile (W's [2N, K/2] view interleaves a row's halves; the
        stage's rows are 4 first halves, then 4 second; the other products pair one half with the other: unused),
        added across threads through shared memory."""
        T.copy(acc, sums[0, :, :])
        T.sync_threads(CONSUMERS_BARRIER, THREADS)
        for i, r in T.Parallel(out_n, step_rows):
            if by * step_rows + r < M:
                C[by * step_rows + r, bx * out_n + i] = T.cast(sums[0, 2 * i, r] + sums[0, 2 * i + 1, r + step_rows],
                                                               BF16)

    @T.macro
    def store_sums(C, acc, up, bx, by):
        """The epilogue of summed products, as the tile lays them out: swapped ([BLOCK_N, rows]) or not."""
        if SWAP_ROWS:
            store_swapped(C, acc, up, bx, by)
        else:
            store(C, acc, up, bx, by)

    def sum_at(acc, r, j):
        """A split plane's row r, column j in acc, which is [ROWS, BLOCK_N], or [BLOCK_N, rows] swapped."""
        return acc[j, r] if SWAP_ROWS else acc[r, j]

    @T.macro
    def meet_ticket(C, P, tickets, acc, ticket, bx, by, first):
        """The split's last CTA of a tile (by its ticket) adds the planes and writes C."""
        T.call_extern("handle", "__threadfence")
        T.sync_threads(CONSUMERS_BARRIER, THREADS)
        if T.get_thread_binding() == 0:
            ticket[0] = T.atomic_add(tickets[by * (N // BLOCK_N) + bx], 1, return_prev=True)
        T.sync_threads(CONSUMERS_BARRIER, THREADS)
        if ticket[0] == SPLIT - 1:
            T.call_extern("handle", "__threadfence")
            T.clear(acc)
            for s in T.serial(SPLIT):  # past L1 (.cg): the other planes were written by other SMs
                for r, j in T.Parallel(rows, BLOCK_N):
                    plane = P[s * ROWS + first + r, bx * BLOCK_N + j]
                    part = T.call_extern("float32", "__ldcg", T.access_ptr(plane, "r"))
                    if SWAP_ROWS:
                        acc[j, r] += part
                    else:
                        acc[r, j] += part
            store_sums(C, acc, None, bx, by)  # unswapped, by is 0: the plane holds the step's 16 rows
            if T.get_thread_binding() == 0:
                tickets[by * (N // BLOCK_N) + bx] = 0

    @T.macro
    def meet_split(C, P, tickets, acc, ticket, bx, by, bz):
        """The split epilogue (M <= 16: a swapped tile's row tiles by share the 16 rows of a plane): this CTA's
        plane, then (unless PARTIAL) its ticket, and the sum if it is last. Loops over the plane's rows and columns:
        over acc's, a swapped tile's __ldcg lost its address."""
        first = by * rows if SWAP_ROWS else 0
        for r, j in T.Parallel(rows, BLOCK_N):
            P[bz * ROWS + first + r, bx * BLOCK_N + j] = sum_at(acc, r, j)
        if not PARTIAL:
            meet_ticket(C, P, tickets, acc, ticket, bx, by, first)

    @T.macro
    def meet_cluster(C, parts, acc, bx, by, bz):
        """The cluster epilogue: ranks past 0 store their sums into rank 0's `parts`, every thread of the cluster
        meets at its barrier (release, acquire), then rank 0 adds the parts in rank order and writes C."""
        T.call_extern("handle", "require_cluster", SPLIT)
        if bz > 0:
            for i, j in T.Parallel(*acc.shape):
                T.call_extern("handle", "store_peer", T.access_ptr(parts[bz - 1, i, j], "w"), acc[i, j], 0)
        T.cluster_arrive()
        T.cluster_wait()
        if bz == 0:
            for s in T.serial(SPLIT - 1):
                for i, j in T.Parallel(*acc.shape):
                    acc[i, j] += parts[s, i, j]
            store_sums(C, acc, None, bx, by)

    @T.macro
    def produce(A, X2, G, W, a_s, g_s, w_s, u_s, w_full, a_full, landed, empty, bx, by, bz):
        """The producer warpgroup: weight stages by TMA, rows (and G) by cp.async."""
        for k in T.serial(ahead):
            load_weights(W, w_s, u_s, w_full, bx, bz, k)
        if NORM:  # G whole, a weight like W: before the wait, and ahead of the first rows that `landed` waits for
            T.async_copy(G[0:K], g_s)
        if PDL:
            T.pdl_sync()
        if PRE or NORM:  # the rows first, then the weight stages not issued before the wait
            for k in T.serial(steps):
                if k >= STAGES:
                    T.mbarrier_wait_parity(empty[k % STAGES], (k // STAGES + 1) % 2)
                if NORM:  # the scalers wait for `landed`, the consumers for `a_full` after them
                    load_rows(A, X2, a_s, landed, by, bz, k)
                else:
                    load_rows(A, X2, a_s, a_full, by, bz, k)
                if k >= ahead:
                    load_weights(W, w_s, u_s, w_full, bx, bz, k)
        else:
            for k in T.serial(steps):
                if k >= STAGES:
                    T.mbarrier_wait_parity(empty[k % STAGES], (k // STAGES + 1) % 2)
                    load_weights(W, w_s, u_s, w_full, bx, bz, k)
                load_rows(A, X2, a_s, a_full, by, bz, k)
        if CLUSTER:  # every thread of the cluster meets at the epilogue's barrier
            T.cluster_arrive()
            T.cluster_wait()

    @T.macro
    def scale_all(a_s, g_s, S, x, squares, total, rstd, landed, a_full, rstd_full, bx, by):
        """NORM: each step's rows scaled as they land, by a warpgroup of their own, so that the producer's loads
        never wait behind a landing (in the producer, each step had waited for rows loaded two steps before)."""
        T.clear(squares)
        for k in T.serial(steps):
            scale_rows(a_s, g_s, S, x, squares, landed, a_full, bx, by, k)
        inverse_rms(squares, total, rstd, rstd_full)

    @T.macro
    def consume(C, P, tickets, a_s, w_s, u_s, acc, up, third, fourth, sums, rstd, ticket, parts, w_full, a_full,
                empty, rstd_full, bx, by, bz):
        """The consumer warps: mma.sync over each stage once its weights and rows are in, then the epilogue."""
        T.clear(acc)
        if ACT or CHAINS > 1:
            T.clear(up)
        if CHAINS == 4:
            T.clear(third)
            T.clear(fourth)
        for k in T.serial(steps):
            T.mbarrier_wait_parity(w_full[k % STAGES], (k // STAGES) % 2)
            T.mbarrier_wait_parity(a_full[k % STAGES], (k // STAGES) % 2)
            multiply_part(a_s, w_s, acc, k % STAGES, 0)
            if ACT:  # up's GEMM over the same rows
                multiply_part(a_s, u_s, up, k % STAGES, 0)
            if CHAINS > 1:
                multiply_part(a_s, w_s, up, k % STAGES, 1)
            if CHAINS == 4:
                multiply_part(a_s, w_s, third, k % STAGES, 2)
                multiply_part(a_s, w_s, fourth, k % STAGES, 3)
            T.mbarrier_arrive(empty[k % STAGES])  # after the GEMMs: both read the same rows
        if CHAINS == 2:
            for i, j in T.Parallel(*acc.shape):
                acc[i, j] += up[i, j]
        if CHAINS == 4:
            for i, j in T.Parallel(*acc.shape):
                acc[i, j] += up[i, j] + third[i, j] + fourth[i, j]
        if NORM:
            T.mbarrier_wait_parity(rstd_full[0], 0)
            store_normed(C, acc, up, sums, rstd, bx, by)
        elif HALVES:
            store_halves(C, acc, sums, bx, by)
        elif CLUSTER:
            meet_cluster(C, parts, acc, bx, by, bz)
        elif SPLIT > 1:
            meet_split(C, P, tickets, acc, ticket, bx, by, bz)
        else:
            store_sums(C, acc, up, bx, by)

    @T.macro
    def tile(A, X2, G, S, W, C, P, tickets):
        threads = THREADS + PRODUCER * (2 if NORM else 1)  # NORM: a warpgroup of scalers after the producer
        cluster = dict(cluster_dims=(1, 1, SPLIT), prelude=PEER_STORE) if CLUSTER else {}
        with T.Kernel(N // out_n, T.ceildiv(M, step_rows), SPLIT, threads=threads, **cluster) as (bx, by, bz):
            a_s = T.alloc_shared((STAGES, rows, BLOCK_K), BF16)
            w_s = T.alloc_shared((STAGES, BLOCK_N, BLOCK_K), BF16)
            u_s = None  # ACT=0: no up half
            if ACT:
                u_s = T.alloc_shared((STAGES, BLOCK_N, BLOCK_K), BF16)
            w_full = T.alloc_barrier([PRODUCER] * STAGES)
            a_full = T.alloc_barrier([PRODUCER] * STAGES)
            empty = T.alloc_barrier([THREADS] * STAGES)
            acc = T.alloc_fragment(sums_shape, T.float32)
            up, third, fourth = None, None, None  # ACT: the up GEMM's sums; CHAINS: those of a stage's other slices
            if ACT or CHAINS > 1:
                up = T.alloc_fragment(sums_shape, T.float32)
            if CHAINS == 4:
                third = T.alloc_fragment(sums_shape, T.float32)
                fourth = T.alloc_fragment(sums_shape, T.float32)
            landed, g_s, x, squares, total, rstd, rstd_full, sums = None, None, None, None, None, None, None, None
            if NORM:  # the rows land (landed), the scalers scale them (a_full), the consumers read them
                landed = T.alloc_barrier([PRODUCER] * STAGES)
                g_s = T.alloc_shared((K,), BF16)
                x = T.alloc_fragment((step_rows, BLOCK_K), T.float32)
                squares = T.alloc_fragment((step_rows, BLOCK_K), T.float32)
                total = T.alloc_fragment((step_rows,), T.float32)
                # rstd and sums in static shared memory, which holds the barriers and is padded to 1 KB anyway: 528
                # bytes off the dynamic allocation, so that QKV's 6 stages fit 3 CTAs an SM (no faster, session 10)
                rstd = T.alloc_shared((step_rows,), T.float32, scope="shared")
                rstd_full = T.alloc_barrier([PRODUCER])
                sums = T.alloc_shared((2 if ACT else 1, BLOCK_N, rows), T.float32, scope="shared")
            if HALVES:  # the epilogue's pairs of products
                sums = T.alloc_shared((1, BLOCK_N, rows), T.float32, scope="shared")
            ticket, parts = None, None
            if CLUSTER:  # the other ranks' sums, in rank 0's shared memory
                parts = T.alloc_shared((SPLIT - 1, *sums_shape), T.float32, scope="shared")
            elif SPLIT > 1:
                ticket = T.alloc_shared((1,), T.int32)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            T.disable_warp_group_reg_alloc()
            if PDL:
                T.pdl_trigger()
            if NORM:  # loads by the producer warpgroup, the norm's scaling by the scaler warpgroup after it
                if T.get_thread_binding() >= THREADS + PRODUCER:
                    scale_all(a_s, g_s, S, x, squares, total, rstd, landed, a_full, rstd_full, bx, by)
                elif T.get_thread_binding() >= THREADS:
                    produce(A, X2, G, W, a_s, g_s, w_s, u_s, w_full, a_full, landed, empty, bx, by, bz)
                else:
                    consume(C, P, tickets, a_s, w_s, u_s, acc, up, third, fourth, sums, rstd, ticket, parts, w_full,
                            a_full, empty, rstd_full, bx, by, bz)
            elif T.get_thread_binding() >= THREADS:
                produce(A, X2, G, W, a_s, g_s, w_s, u_s, w_full, a_full, landed, empty, bx, by, bz)
            else:
                consume(C, P, tickets, a_s, w_s, u_s, acc, up, third, fourth, sums, rstd, ticket, parts, w_full, a_full,
                        empty, rstd_full, bx, by, bz)

    if PARTIAL:
        @T.prim_func
        def decode_gemm_planes(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16),
                               P: T.Tensor((SPLIT * ROWS, N), T.float32)):
            tile(A, None, None, None, W, None, P, None)
        return decode_gemm_planes
    if SPLIT > 1 and not CLUSTER:
        @T.prim_func
        def decode_gemm_split(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16), C: T.Tensor((M, N), BF16),
                              P: T.Tensor((SPLIT * ROWS, N), T.float32),
                              tickets: T.Tensor((ROWS // rows * N // BLOCK_N,), T.int32)):
            tile(A, None, None, None, W, C, P, tickets)
        return decode_gemm_split
    if WRITE_SUM:
        @T.prim_func
        def decode_gemm_add_norm_sum(A: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                                     S: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16),
                                     C: T.Tensor((M, N), BF16)):
            tile(A, X2, G, S, W, C, None, None)
        return decode_gemm_add_norm_sum
    if ADD:
        @T.prim_func
        def decode_gemm_add_norm(A: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                                 W: T.Tensor((w_rows, K), BF16), C: T.Tensor((M, N), BF16)):
            tile(A, X2, G, None, W, C, None, None)
        return decode_gemm_add_norm
    if NORM:
        @T.prim_func
        def decode_gemm_norm(A: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16), W: T.Tensor((w_rows, K), BF16),
                             C: T.Tensor((M, N), BF16)):
            tile(A, None, G, None, W, C, None, None)
        return decode_gemm_norm

    # HALVES: W as [2N, K/2], the same memory, so that a TMA box of 16 rows holds 8 weight rows' two K halves
    w_shape = (2 * N, K // 2) if HALVES else (w_rows, K)

    @T.prim_func
    def decode_gemm(A: T.Tensor((M, K), BF16), W: T.Tensor(w_shape, BF16), C: T.Tensor((M, N), BF16)):
        tile(A, None, None, None, W, C, None, None)
    return decode_gemm
