"""y = x @ W^T on the tensor cores, TMA loads into swizzled shared memory and wgmma on sm_90a (mma.sync and
cp.async on sm_80), with an optional epilogue: act(gate) * up over a merged [2N, K] weight (ACT=1: SiLU), or a
residual added to the product (RESIDUAL); `gemm_merged` computes the SiLU x up epilogue with one accumulator for
both halves; `gemm_inflight` (INFLIGHT, sm_90a) writes the warp specialisation out to keep one wgmma batch in flight
across K steps. The row count M is dynamic; N and K are fixed per kernel."""

import tilelang.language as T

BF16 = T.bfloat16


def gemm(N: int, K: int, ACT: int, RESIDUAL: bool, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, STAGES: int,
         THREADS: int, SWIZZLE: int, FULL_ROW: bool = False, MERGED: bool = False, INFLIGHT: bool = False):
    if MERGED:  # only the SiLU x up epilogue has two halves to merge
        assert ACT == 1 and not RESIDUAL, "a merged tile computes SiLU(gate) * up"
    if INFLIGHT:
        assert FULL_ROW and not RESIDUAL and ACT == int(MERGED), "an in-flight tile is plain or merged, on whole rows"
        return gemm_inflight(N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, THREADS, SWIZZLE, MERGED)
    if MERGED:
        return gemm_merged(N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, THREADS, SWIZZLE, FULL_ROW)
    M = T.dynamic("M")
    policy = T.GemmWarpPolicy.FullRow if FULL_ROW else T.GemmWarpPolicy.Square
    w_rows = 2 * N if ACT else N

    @T.macro
    def tile(A, W, R, C):
        with T.Kernel(T.ceildiv(N, BLOCK_N), T.ceildiv(M, BLOCK_M), threads=THREADS) as (bx, by):
            a_s = T.alloc_shared((BLOCK_M, BLOCK_K), BF16)
            w_s = T.alloc_shared((BLOCK_N, BLOCK_K), BF16)
            acc = T.alloc_fragment((BLOCK_M, BLOCK_N), T.float32)
            c_s = T.alloc_shared((BLOCK_M, BLOCK_N), BF16)
            T.use_swizzle(SWIZZLE, enable=SWIZZLE > 0)
            T.clear(acc)
            if ACT:
                u_s = T.alloc_shared((BLOCK_N, BLOCK_K), BF16)
                up = T.alloc_fragment((BLOCK_M, BLOCK_N), T.float32)
                T.clear(up)
                for k in T.Pipelined(T.ceildiv(K, BLOCK_K), num_stages=STAGES):
                    T.copy(A[by * BLOCK_M, k * BLOCK_K], a_s)
                    T.copy(W[bx * BLOCK_N, k * BLOCK_K], w_s)
                    T.copy(W[N + bx * BLOCK_N, k * BLOCK_K], u_s)
                    T.gemm(a_s, w_s, acc, transpose_B=True, policy=policy)
                    T.gemm(a_s, u_s, up, transpose_B=True, policy=policy)
                for i, j in T.Parallel(BLOCK_M, BLOCK_N):  # SiLU(gate) * up, as the Triton epilogue computes it
                    acc[i, j] = acc[i, j] / (1.0 + T.exp(-acc[i, j])) * up[i, j]
            else:
                for k in T.Pipelined(T.ceildiv(K, BLOCK_K), num_stages=STAGES):
                    T.copy(A[by * BLOCK_M, k * BLOCK_K], a_s)
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
            silu_mul(acc, up, BLOCK_M, BLOCK_N)
            T.copy(up, c_s)
            T.copy(c_s, C[by * BLOCK_M, bx * BLOCK_N])
    return gemm


@T.macro
def silu_mul(acc, up, BLOCK_M: int, BLOCK_N: int):
    """SiLU(gate) * up into `up` from one merged accumulator (gate columns, then up columns). A T.Parallel loop may
    index a fragment one way only, so the up half moves to a fragment of its own first (register moves within each
    thread); the product then lands there in fp32, as in gemm's ACT epilogue, and leaves through stmatrix like any
    accumulator."""
    for i, j in T.Parallel(BLOCK_M, BLOCK_N):
        up[i, j] = acc[i, j + BLOCK_N]
    for i, j in T.Parallel(BLOCK_M, BLOCK_N):
        up[i, j] = acc[i, j] / (1.0 + T.exp(-acc[i, j])) * up[i, j]


def gemm_inflight(N: int, K: int, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, STAGES: int, THREADS: int,
                  SWIZZLE: int, MERGED: bool):
    """The TMA + wgmma GEMM with its warp specialisation written out, to keep one wgmma batch in flight.
    T.Pipelined's consumer waits for each K step's batch to finish (wait_group 0) before it releases the stage and
    issues the next step, so the tensor cores idle for that wait every step; here, as in CUTLASS's main loop, step
    k's batch is issued (T.wgmma_gemm: no implicit wait), then step k - 1's is waited for (wait_wgmma(1): groups
    complete in order) and only then is stage k - 1 handed back to the producer. Warpgroups 0 .. THREADS/128 - 1
    consume, each on whole tile rows (m64nN); the last warpgroup loads through TMA. full[s] completes a phase when
    stage s has landed (its TMA bytes, and an arrival from each producer thread); empty[s] when every consumer
    thread has released it. MERGED computes SiLU(gate) * up as `gemm_merged` does, else C = A W^T."""
    assert THREADS == 256, "the register split below (24 producer + 2 x 240 consumer) is for two consumer warpgroups"
    M = T.dynamic("M")
    w_rows, n_tile = (2 * N, 2 * BLOCK_N) if MERGED else (N, BLOCK_N)
    steps = T.ceildiv(K, BLOCK_K)
    acc_regs = BLOCK_M * n_tile // THREADS  # the fp32 accumulator registers of a consumer thread

    @T.macro
    def produce(A, W, a_s, w_s, full, empty, bx, by):
        for k in T.serial(steps):
            s = k % STAGES
            T.mbarrier_wait_parity(empty[s], ((k // STAGES) & 1) ^ 1)  # the first pass finds every stage free
            T.tma_copy(A[by * BLOCK_M:(by + 1) * BLOCK_M, k * BLOCK_K:(k + 1) * BLOCK_K], a_s[s, :, :],
                       barrier=full[s])
            T.tma_copy(W[bx * BLOCK_N:(bx + 1) * BLOCK_N, k * BLOCK_K:(k + 1) * BLOCK_K], w_s[s, 0:BLOCK_N, :],
                       barrier=full[s])
            if MERGED:  # the up rows of the same output columns, below the gate rows
                T.tma_copy(W[N + bx * BLOCK_N:N + (bx + 1) * BLOCK_N, k * BLOCK_K:(k + 1) * BLOCK_K],
                           w_s[s, BLOCK_N:2 * BLOCK_N, :], barrier=full[s])
            T.mbarrier_arrive(full[s])

    @T.macro
    def consume(a_s, w_s, acc, full, empty):
        T.clear(acc)
        for k in T.serial(steps):
            s = k % STAGES
            T.mbarrier_wait_parity(full[s], (k // STAGES) & 1)
            T.wgmma_gemm(a_s[s, :, :], w_s[s, :, :], acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(1)  # step k - 1's batch is done, step k's may still run
            if k > 0:
                T.mbarrier_arrive(empty[(k + STAGES - 1) % STAGES])
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc, num_regs=acc_regs)  # no read of the sums above the wait

    @T.prim_func
    def gemm(A: T.Tensor((M, K), BF16), W: T.Tensor((w_rows, K), BF16), C: T.Tensor((M, N), BF16)):
        with T.Kernel(T.ceildiv(N, BLOCK_N), T.ceildiv(M, BLOCK_M), threads=THREADS + 128) as (bx, by):
            a_s = T.alloc_shared((STAGES, BLOCK_M, BLOCK_K), BF16)
            w_s = T.alloc_shared((STAGES, n_tile, BLOCK_K), BF16)
            acc = T.alloc_fragment((BLOCK_M, n_tile), T.float32)
            c_s = T.alloc_shared((BLOCK_M, BLOCK_N), BF16)
            full = T.alloc_barrier([128] * STAGES)
            empty = T.alloc_barrier([THREADS] * STAGES)
            T.use_swizzle(SWIZZLE, enable=SWIZZLE > 0)
            # the roles in one if/else: as two T.ws blocks, a __syncthreads between them would deadlock the producer
            if T.get_thread_binding() >= THREADS:
                T.set_max_nreg(24, 0)
                produce(A, W, a_s, w_s, full, empty, bx, by)
            else:
                T.set_max_nreg(240, 1)
                consume(a_s, w_s, acc, full, empty)
                if MERGED:
                    up = T.alloc_fragment((BLOCK_M, BLOCK_N), T.float32)
                    silu_mul(acc, up, BLOCK_M, BLOCK_N)
                    T.copy(up, c_s)
                else:
                    T.copy(acc, c_s)
                T.copy(c_s, C[by * BLOCK_M, bx * BLOCK_N])
    return gemm


def add_rms_norm(K: int, EPS: float, ADD: bool, WRITE_SUM: bool, THREADS: int):
    """The GEMM's prologue as its own launch (a TMA-fed GEMM reads its operand as stored): per row, the residual
    sum X + X2 (written to S when WRITE_SUM) and its RMSNorm times G, rounded to bf16 as the GEMM reads it."""
    M = T.dynamic("M")

    @T.macro
    def row_kernel(X, X2, G, S, Y):
        with T.Kernel(M, threads=THREADS) as row:
            x = T.alloc_fragment((1, K), T.float32)
            squares = T.alloc_fragment((1, K), T.float32)
            total = T.alloc_fragment((1,), T.float32)
            for i, j in T.Parallel(1, K):
                if ADD:
                    x[i, j] = T.cast(X[row, j], T.float32) + T.cast(X2[row, j], T.float32)
                else:
                    x[i, j] = T.cast(X[row, j], T.float32)
            for i, j in T.Parallel(1, K):
                if WRITE_SUM:
                    S[row, j] = T.cast(x[i, j], BF16)
                squares[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(squares, total, dim=1)
            for i, j in T.Parallel(1, K):
                Y[row, j] = T.cast(x[i, j] * T.rsqrt(total[i] / K + EPS) * T.cast(G[j], T.float32), BF16)

    if ADD and WRITE_SUM:
        @T.prim_func
        def add_rms_norm(X: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                         S: T.Tensor((M, K), BF16), Y: T.Tensor((M, K), BF16)):
            row_kernel(X, X2, G, S, Y)
        return add_rms_norm
    if ADD:
        @T.prim_func
        def add_rms_norm(X: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                         Y: T.Tensor((M, K), BF16)):
            row_kernel(X, X2, G, None, Y)
        return add_rms_norm

    @T.prim_func
    def rms_norm(X: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16), Y: T.Tensor((M, K), BF16)):
        row_kernel(X, None, G, None, Y)
    return rms_norm
