"""y = x @ W^T for decode steps of at most 16 rows, stream-K: CTAS CTAs (a whole number an SM) walk the flattened
(output tile, K step) iterations in equal contiguous ranges, so that every SM streams the same weight bytes whatever
N is. With one CTA a tile, 2560 columns make 160 tiles of 16 on 132 SMs: 28 SMs stream two tiles while the rest
stream one, and the kernel runs at the pace of the 28. A range covers the end of a tile, whole tiles, and the start
of another: a tile wholly in one range is stored at once; a part goes to its CTA's slot of P (fp32) and takes the
tile's ticket, and the last of the tile's CTAs adds the parts in CTA order (the same sum whichever CTA is last),
stores C and resets the ticket for the next launch (the runtime zeroes the tickets once).

As decode_gemm.py: a producer warpgroup streams the weight tiles by TMA (PDL: the first STAGES before it waits for
the previous kernel, which the weights never depend on) and the step's rows by predicated cp.async (rows past M
zero-filled); the consumers run mma.sync on the 16-row tile and free a stage once its GEMM is done; they write P and
C only after rows loaded after the wait, so a programmatic launch never overwrites parts the previous one reads."""

import tilelang.language as T

BF16 = T.bfloat16
ROWS = 16  # mma.sync's M: the step's rows
PRODUCER = 128  # the producer warpgroup's threads, after the THREADS consumers
CONSUMERS_BARRIER = 1  # a named barrier of the consumers alone (0 is the whole CTA's)


def stream_gemm(N: int, K: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int, MIN_BLOCKS: int, CTAS: int,
                PDL: bool = False):
    assert N % BLOCK_N == 0 and K % BLOCK_K == 0, f"N={N}, K={K} must be whole {BLOCK_N}x{BLOCK_K} tiles"
    k_steps = K // BLOCK_K
    total = N // BLOCK_N * k_steps  # iterations: (tile, K step) pairs, tile-major
    assert CTAS <= total, f"{CTAS} CTAs for {total} iterations: some would have none"
    M = T.dynamic("M")

    def first(c):
        """CTA c's first iteration (the next CTA's first ends its range)."""
        return c * total // CTAS

    def owner(x):
        """The CTA whose range holds iteration x."""
        return ((x + 1) * CTAS + total - 1) // total - 1

    def slot(c, tile):
        """Where CTA c leaves its part of `tile` in P: its first tile's in slot 2c, its last one's in 2c + 1."""
        return 2 * c + T.cast(tile != first(c) // k_steps, T.int32)

    @T.macro
    def load_weights(W, w_s, w_full, g, i):
        stage, tile, col = i % STAGES, g // k_steps, g % k_steps * BLOCK_K
        T.tma_copy(W[tile * BLOCK_N:(tile + 1) * BLOCK_N, col:col + BLOCK_K], w_s[stage, :, :], barrier=w_full[stage])
        T.mbarrier_arrive(w_full[stage])

    @T.macro
    def load_rows(A, a_s, a_full, g, i):
        stage, col = i % STAGES, g % k_steps * BLOCK_K
        T.async_copy(A[0:ROWS, col:col + BLOCK_K], a_s[stage, :, :])
        T.cp_async_barrier_noinc(a_full[stage])  # arrives once all this thread's copies so far have landed

    @T.macro
    def store(C, acc, tile):
        for i, j in T.Parallel(ROWS, BLOCK_N):
            if i < M:
                C[i, tile * BLOCK_N + j] = T.cast(acc[i, j], BF16)

    @T.macro
    def finish_tile(C, P, tickets, acc, ticket, c, tile):
        """A tile's segment done: stored if the tile is this CTA's alone, else left in P; the tile's last CTA sums
        the parts in CTA order, stores and resets the ticket."""
        owners = owner(tile * k_steps + k_steps - 1) - owner(tile * k_steps) + 1
        if owners == 1:
            store(C, acc, tile)
        else:
            for i, j in T.Parallel(ROWS, BLOCK_N):
                P[slot(c, tile) * ROWS + i, j] = acc[i, j]
            T.call_extern("handle", "__threadfence")
            T.sync_threads(CONSUMERS_BARRIER, THREADS)
            if T.get_thread_binding() == 0:
                ticket[0] = T.atomic_add(tickets[tile], 1, return_prev=True)
            T.sync_threads(CONSUMERS_BARRIER, THREADS)
            if ticket[0] == owners - 1:
                T.call_extern("handle", "__threadfence")
                T.clear(acc)
                for o in T.serial(owners):  # past L1 (.cg): the other parts were written by other SMs
                    part = slot(owner(tile * k_steps) + o, tile) * ROWS
                    for i, j in T.Parallel(ROWS, BLOCK_N):
                        acc[i, j] += T.call_extern("float32", "__ldcg", T.address_of(P[part + i, j]))
                store(C, acc, tile)
                if T.get_thread_binding() == 0:
                    tickets[tile] = 0
            T.sync_threads(CONSUMERS_BARRIER, THREADS)  # `ticket` is read by all before the next part takes one

    @T.prim_func
    def stream_gemm(A: T.Tensor((M, K), BF16), W: T.Tensor((N, K), BF16), C: T.Tensor((M, N), BF16),
                    P: T.Tensor((2 * CTAS * ROWS, BLOCK_N), T.float32), tickets: T.Tensor((N // BLOCK_N,), T.int32)):
        with T.Kernel(CTAS, threads=THREADS + PRODUCER) as c:
            a_s = T.alloc_shared((STAGES, ROWS, BLOCK_K), BF16)
            w_s = T.alloc_shared((STAGES, BLOCK_N, BLOCK_K), BF16)
            w_full = T.alloc_barrier([PRODUCER] * STAGES)
            a_full = T.alloc_barrier([PRODUCER] * STAGES)
            empty = T.alloc_barrier([THREADS] * STAGES)
            acc = T.alloc_fragment((ROWS, BLOCK_N), T.float32)
            ticket = T.alloc_shared((1,), T.int32)
            start, count = first(c), first(c + 1) - first(c)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            T.disable_warp_group_reg_alloc()
            if PDL:
                T.pdl_trigger()
            if T.get_thread_binding() >= THREADS:
                for i in T.serial(T.min(STAGES, count)):
                    load_weights(W, w_s, w_full, start + i, i)
                if PDL:
                    T.pdl_sync()
                for i in T.serial(count):
                    if i >= STAGES:
                        T.mbarrier_wait_parity(empty[i % STAGES], (i // STAGES + 1) % 2)
                        load_weights(W, w_s, w_full, start + i, i)
                    load_rows(A, a_s, a_full, start + i, i)
            else:
                T.clear(acc)
                for i in T.serial(count):
                    T.mbarrier_wait_parity(w_full[i % STAGES], (i // STAGES) % 2)
                    T.mbarrier_wait_parity(a_full[i % STAGES], (i // STAGES) % 2)
                    T.gemm(a_s[i % STAGES, :, :], w_s[i % STAGES, :, :], acc, transpose_B=True)
                    T.mbarrier_arrive(empty[i % STAGES])
                    if (start + i) % k_steps == k_steps - 1 or i == count - 1:
                        finish_tile(C, P, tickets, acc, ticket, c, (start + i) // k_steps)
                        T.clear(acc)

    return stream_gemm
