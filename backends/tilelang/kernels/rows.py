"""Row launches beside the GEMMs: a GEMM's [add +] RMSNorm prologue as a launch of its own (a TMA-fed GEMM reads its
operand as stored), and the sum of a split GEMM's fp32 planes (decode_planes.py) where no kernel after it adds
them. One CTA a row; M is dynamic, K (N) fixed."""

import tilelang.language as T

BF16 = T.bfloat16
PLANE_ROWS = 16  # a split GEMM's plane holds 16 rows (decode_ring.py's ROWS), whatever M


def norm_weight(weight, NORM_OFFSET: float):
    """A norm's weight, already cast to float32, plus NORM_OFFSET for a norm that scales by offset + G (1 + G for
    weights stored around zero); added only where there is an offset, so that a plain norm's code is what it always
    was."""
    return weight + NORM_OFFSET if NORM_OFFSET else weight


def add_rms_norm(K: int, EPS: float, ADD: bool, WRITE_SUM: bool, THREADS: int, PDL: bool = False,
                 PLANES: int = 0, NORM_OFFSET: float = 0.0, PLANE_STRIDE: int = PLANE_ROWS):
    """Per row, the residual sum X + X2 (written to S when WRITE_SUM) and its RMSNorm times G (+ NORM_OFFSET, in
    float32), rounded to bf16 as the GEMM reads it. PDL: the next kernel (the GEMM, launched programmatically) may
    start at once, so that its first weight stages stream while the rows are normed; G, a weight, is loaded before
    the wait for the previous kernel, off the path from that kernel's end to the GEMM's rows. PLANES: X2 may come as
    a split GEMM's fp32 planes P ([PR, K], PR / PLANE_STRIDE planes, at most PLANES; PR = 0: X2 as stored: 16 rows
    a plane from decode_planes.py, 256 from swapped.py), added in plane order and rounded to bf16 as the deferred
    sum would have stored X2, their loads unrolled, predicated and issued at once."""
    assert ADD or not (WRITE_SUM or PLANES), "WRITE_SUM and PLANES concern the add's sum and its second operand"
    M = T.dynamic("M")
    PR = T.dynamic("PR")

    @T.macro
    def row_kernel(X, X2, G, S, Y, P):
        with T.Kernel(M, threads=THREADS) as row:
            x = T.alloc_fragment((1, K), T.float32)
            squares = T.alloc_fragment((1, K), T.float32)
            total = T.alloc_fragment((1,), T.float32)
            g, delta = None, None
            if PDL:
                g = T.alloc_fragment((1, K), T.float32)
                T.pdl_trigger()
                for i, j in T.Parallel(1, K):
                    g[i, j] = norm_weight(T.cast(G[j], T.float32), NORM_OFFSET)
                T.pdl_sync()
            if PLANES:
                delta = T.alloc_fragment((1, K), T.float32)
                T.clear(delta)
                for s in T.unroll(PLANES):
                    for i, j in T.Parallel(1, K):
                        delta[i, j] += T.if_then_else(s * PLANE_STRIDE < PR, P[s * PLANE_STRIDE + row, j], 0.0)
            for i, j in T.Parallel(1, K):
                if PLANES:
                    if PR > 0:
                        x[i, j] = T.cast(X[row, j], T.float32) + T.cast(T.cast(delta[i, j], BF16), T.float32)
                    else:
                        x[i, j] = T.cast(X[row, j], T.float32) + T.cast(X2[row, j], T.float32)
                elif ADD:
                    x[i, j] = T.cast(X[row, j], T.float32) + T.cast(X2[row, j], T.float32)
                else:
                    x[i, j] = T.cast(X[row, j], T.float32)
            for i, j in T.Parallel(1, K):
                if WRITE_SUM:
                    S[row, j] = T.cast(x[i, j], BF16)
                squares[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(squares, total, dim=1)
            for i, j in T.Parallel(1, K):
                weight = g[i, j] if PDL else norm_weight(T.cast(G[j], T.float32), NORM_OFFSET)
                Y[row, j] = T.cast(x[i, j] * T.rsqrt(total[i] / K + EPS) * weight, BF16)

    if PLANES and WRITE_SUM:
        @T.prim_func
        def add_rms_norm(X: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                         S: T.Tensor((M, K), BF16), Y: T.Tensor((M, K), BF16), P: T.Tensor((PR, K), T.float32)):
            row_kernel(X, X2, G, S, Y, P)
        return add_rms_norm
    if PLANES:
        @T.prim_func
        def add_rms_norm(X: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                         Y: T.Tensor((M, K), BF16), P: T.Tensor((PR, K), T.float32)):
            row_kernel(X, X2, G, None, Y, P)
        return add_rms_norm
    if ADD and WRITE_SUM:
        @T.prim_func
        def add_rms_norm(X: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                         S: T.Tensor((M, K), BF16), Y: T.Tensor((M, K), BF16)):
            row_kernel(X, X2, G, S, Y, None)
        return add_rms_norm
    if ADD:
        @T.prim_func
        def add_rms_norm(X: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                         Y: T.Tensor((M, K), BF16)):
            row_kernel(X, X2, G, None, Y, None)
        return add_rms_norm

    @T.prim_func
    def rms_norm(X: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16), Y: T.Tensor((M, K), BF16)):
        row_kernel(X, None, G, None, Y, None)
    return rms_norm


def sum_planes(N: int, SPLIT: int, THREADS: int, PDL: bool = False):
    """C = a split GEMM's SPLIT fp32 planes added in plane order, rounded to bf16: the sum decode_planes.py leaves
    out, run by the runtime only where a kernel after it reads C itself (add_rms_norm's PLANES adds them instead)."""
    M = T.dynamic("M")

    @T.prim_func
    def sum_planes(P: T.Tensor((SPLIT * PLANE_ROWS, N), T.float32), C: T.Tensor((M, N), BF16)):
        with T.Kernel(M, threads=THREADS) as row:
            total = T.alloc_fragment((1, N), T.float32)
            if PDL:
                T.pdl_trigger()
                T.pdl_sync()
            T.clear(total)
            for s in T.unroll(SPLIT):
                for i, j in T.Parallel(1, N):
                    total[i, j] += P[s * PLANE_ROWS + row, j]
            for i, j in T.Parallel(1, N):
                C[row, j] = T.cast(total[i, j], BF16)
    return sum_planes


FP8_MAX = 448.0  # e4m3's largest finite value
GROUP = 128  # gemm_fp8.py's quantization group


def quantize_rows(K: int, EPS: float, NORM: bool, ADD: bool, WRITE_SUM: bool, THREADS: int, PDL: bool = False,
                  NORM_OFFSET: float = 0.0):
    """The rows of an FP8 GEMM (gemm_fp8.py) in e4m3 groups of 128 columns: per row [the residual sum X + X2 in
    bf16, written to S] [its RMSNorm times G (+ NORM_OFFSET, in float32), rounded to bf16 once], then each group
    over its largest magnitude / 448 (AS, [M, K / 128]) and rounded to e4m3 (Y), as vLLM's per-token-group
    quantization does. PDL: the GEMM after it, launched programmatically, may start at once (and waits for it)."""
    assert NORM or not (ADD or WRITE_SUM), "an add without a norm is not a shape the passes make"
    assert K % GROUP == 0, K
    M = T.dynamic("M")
    KB = K // GROUP

    @T.macro
    def row_kernel(X, X2, G, S, Y, AS):
        with T.Kernel(M, threads=THREADS) as row:
            x = T.alloc_fragment((KB, GROUP), T.float32)
            squares = T.alloc_fragment((KB, GROUP), T.float32)
            partial = T.alloc_fragment((KB,), T.float32)
            total = T.alloc_fragment((1,), T.float32)
            amax = T.alloc_fragment((KB,), T.float32)
            if PDL:
                T.pdl_trigger()
                T.pdl_sync()
            for g, j in T.Parallel(KB, GROUP):  # the residual sum in bf16, as the graph's add rounds it
                if ADD:
                    x[g, j] = T.cast(T.cast(T.cast(X[row, g * GROUP + j], T.float32)
                                            + T.cast(X2[row, g * GROUP + j], T.float32), BF16), T.float32)
                else:
                    x[g, j] = T.cast(X[row, g * GROUP + j], T.float32)
            if NORM:
                for g, j in T.Parallel(KB, GROUP):
                    if WRITE_SUM:
                        S[row, g * GROUP + j] = T.cast(x[g, j], BF16)
                    squares[g, j] = x[g, j] * x[g, j]
                T.reduce_sum(squares, partial, dim=1)
                T.reduce_sum(partial, total, dim=0)
                for g, j in T.Parallel(KB, GROUP):
                    x[g, j] = T.cast(T.cast(x[g, j] * T.rsqrt(total[0] / K + EPS)
                                            * norm_weight(T.cast(G[g * GROUP + j], T.float32), NORM_OFFSET), BF16),
                                     T.float32)
            T.reduce_absmax(x, amax, dim=1)
            for g in T.Parallel(KB):
                amax[g] = T.max(amax[g], 1e-10) / FP8_MAX
                AS[row, g] = amax[g]
            for g, j in T.Parallel(KB, GROUP):
                Y[row, g * GROUP + j] = T.cast(x[g, j] / amax[g], T.float8_e4m3fn)

    FP8 = T.float8_e4m3fn
    if ADD and WRITE_SUM:
        @T.prim_func
        def quantize_rows(X: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                          S: T.Tensor((M, K), BF16), Y: T.Tensor((M, K), FP8), AS: T.Tensor((M, KB), T.float32)):
            row_kernel(X, X2, G, S, Y, AS)
        return quantize_rows
    if ADD:
        @T.prim_func
        def quantize_rows(X: T.Tensor((M, K), BF16), X2: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16),
                          Y: T.Tensor((M, K), FP8), AS: T.Tensor((M, KB), T.float32)):
            row_kernel(X, X2, G, None, Y, AS)
        return quantize_rows
    if NORM:
        @T.prim_func
        def quantize_rows(X: T.Tensor((M, K), BF16), G: T.Tensor((K,), BF16), Y: T.Tensor((M, K), FP8),
                          AS: T.Tensor((M, KB), T.float32)):
            row_kernel(X, None, G, None, Y, AS)
        return quantize_rows

    @T.prim_func
    def quantize_rows(X: T.Tensor((M, K), BF16), Y: T.Tensor((M, K), FP8), AS: T.Tensor((M, KB), T.float32)):
        row_kernel(X, None, None, None, Y, AS)
    return quantize_rows
