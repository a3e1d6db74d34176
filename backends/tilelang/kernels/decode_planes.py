"""y = x @ W^T for decode steps of up to 16 rows, split over K into SPLIT ranges whose CTAs each store their fp32
sums to a plane of P ([SPLIT x 16, N]), with no sum in the kernel: a narrow N then spreads over every SM, and no
fence, ticket or cluster barrier waits at the end. The kernel after it adds the planes where it reads this GEMM's
output as its add's second operand (rows.py's add_rms_norm with PLANES); where no kernel does, the runtime runs
rows.py's sum_planes first (runtime/gpu/planes.py)."""

import tilelang.language as T

from pegainfer.backends.tilelang.kernels.decode_ring import (BF16, PRODUCER, ROWS, Ring, allocator, multiplier,
                                                             producer, row_loader, starter)


def decode_planes(N: int, K: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int, MIN_BLOCKS: int,
                  SPLIT: int, PDL: bool = False, PRE: int = 0, CHAINS: int = 1, PARTIAL: bool = True):
    """PARTIAL: the manifest's mark that this launch leaves its output as planes (the runtime defers their sum)."""
    assert PARTIAL, "decode_planes always leaves its sum to the kernel after it"
    assert SPLIT > 1 and K % (BLOCK_K * SPLIT) == 0, f"K={K} must split into {SPLIT} > 1 ranges of whole " \
        f"{BLOCK_K}-wide steps"
    ring = Ring(N, K, 0, BLOCK_N, BLOCK_K, STAGES, THREADS, MIN_BLOCKS, CHAINS, PDL, PRE, rows=ROWS, swapped=False,
                steps=K // BLOCK_K // SPLIT, rows_first=PRE > 0)
    M = T.dynamic("M")
    issue_ahead, stream = producer(ring, row_loader(ring))
    multiply_all, start, alloc_stages = multiplier(ring), starter(ring), allocator(ring)

    @T.macro
    def store_plane(P, acc, bx, bz):
        for r, j in T.Parallel(ROWS, BLOCK_N):
            P[bz * ROWS + r, bx * BLOCK_N + j] = acc[r, j]

    @T.macro
    def tile(A, W, P):
        with T.Kernel(N // BLOCK_N, T.ceildiv(M, ROWS), SPLIT, threads=THREADS + PRODUCER) as (bx, by, bz):
            b = alloc_stages()
            start()
            if T.get_thread_binding() >= THREADS:
                issue_ahead(W, b, bx, bz)
                stream(A, None, W, b, b.a_full, bx, by, bz)
            else:
                multiply_all(b)
                store_plane(P, b.acc, bx, bz)

    @T.prim_func
    def decode_gemm_planes(A: T.Tensor((M, K), BF16), W: T.Tensor((N, K), BF16),
                           P: T.Tensor((SPLIT * ROWS, N), T.float32)):
        tile(A, W, P)
    return decode_gemm_planes
