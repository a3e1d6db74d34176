"""y = x @ W^T with both operands e4m3 on Hopper's FP8 tensor cores (wgmma e4m3 x e4m3 into fp32): the rows come
quantized in groups of 128 columns (rows.py `quantize_rows`: A, and AS their scales, [M, K / 128]; a CTA loads its
rows' scales whole before the pipeline, since a producer warpgroup issuing copies other than TMA's keeps TileLang
from giving the consumers its registers), and a K step is one group of the rows and one block of the weights, so its
product lands in a fresh accumulator and is added to the sums times its row's scale (and, SCALE 2, the weight
block's): scales change along K, which one accumulator over all of K cannot apply. SCALE 1 (a scale per output
column) multiplies the finished sums. ACT 1: SiLU(gate) * up over the merged [2N, K] weight, gate and up rows in one
shared tile and one accumulator, as gemm.py's `gemm_merged`."""

import tilelang.language as T

from pegainfer.backends.tilelang.kernels.gemm import silu_times

BF16 = T.bfloat16
FP8 = T.float8_e4m3fn
F32 = T.float32
GROUP = 128  # the columns of a row's quantization group, a weight scale block's width and a K step


def gemm_fp8(N: int, K: int, ACT: int, SCALE: int, BLOCK_M: int, BLOCK_N: int, STAGES: int, THREADS: int,
             SWIZZLE: int):
    assert K % GROUP == 0 and SCALE in (1, 2), (K, SCALE)
    assert SCALE == 1 or GROUP % BLOCK_N == 0, "a tile's columns of gate (or up) within one weight block"
    M = T.dynamic("M")
    KB = K // GROUP
    w_rows = 2 * N if ACT else N
    halves = 2 if ACT else 1
    cols = halves * BLOCK_N
    ws_shape = (w_rows // GROUP, KB) if SCALE == 2 else (w_rows, 1)

    @T.prim_func
    def gemm_fp8(A: T.Tensor((M, K), FP8), AS: T.Tensor((M, KB), F32), W: T.Tensor((w_rows, K), FP8),
                 WS: T.Tensor(ws_shape, F32), C: T.Tensor((M, N), BF16)):
        with T.Kernel(T.ceildiv(N, BLOCK_N), T.ceildiv(M, BLOCK_M), threads=THREADS) as (bx, by):
            a_s = T.alloc_shared((BLOCK_M, GROUP), FP8)
            w_s = T.alloc_shared((cols, GROUP), FP8)  # gate rows, then (ACT) up rows
            row_scales = T.alloc_shared((BLOCK_M, KB), F32)
            part = T.alloc_fragment((BLOCK_M, cols), F32)
            acc = T.alloc_fragment((BLOCK_M, cols), F32)
            gate_scale = T.alloc_local((1,), F32)
            up_scale = T.alloc_local((1,), F32)
            c_s = T.alloc_shared((BLOCK_M, BLOCK_N), BF16)
            T.use_swizzle(SWIZZLE, enable=SWIZZLE > 0)
            T.clear(acc)
            for i, g in T.Parallel(BLOCK_M, KB):
                row_scales[i, g] = T.if_then_else(by * BLOCK_M + i < M, AS[by * BLOCK_M + i, g], 0.0)
            for k in T.Pipelined(KB, num_stages=STAGES):
                T.copy(A[by * BLOCK_M, k * GROUP], a_s)
                if ACT:
                    T.copy(W[bx * BLOCK_N, k * GROUP], w_s[0:BLOCK_N, :])
                    T.copy(W[N + bx * BLOCK_N, k * GROUP], w_s[BLOCK_N:2 * BLOCK_N, :])
                else:
                    T.copy(W[bx * BLOCK_N, k * GROUP], w_s)
                T.gemm(a_s, w_s, part, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if SCALE == 2:
                    gate_scale[0] = WS[bx * BLOCK_N // GROUP, k]
                    up_scale[0] = WS[(N + bx * BLOCK_N) // GROUP, k] if ACT else gate_scale[0]
                    for i, j in T.Parallel(BLOCK_M, cols):
                        acc[i, j] += part[i, j] * row_scales[i, k] * T.if_then_else(j < BLOCK_N, gate_scale[0],
                                                                                  up_scale[0])
                else:
                    for i, j in T.Parallel(BLOCK_M, cols):
                        acc[i, j] += part[i, j] * row_scales[i, k]
            if SCALE == 1:
                for i, j in T.Parallel(BLOCK_M, cols):
                    acc[i, j] *= WS[(j // BLOCK_N) * N + bx * BLOCK_N + j % BLOCK_N, 0]
            if ACT:
                up = T.alloc_fragment((BLOCK_M, BLOCK_N), F32)
                for i, j in T.Parallel(BLOCK_M, BLOCK_N):  # a fragment indexed one way per loop: up moves first
                    up[i, j] = acc[i, j + BLOCK_N]
                for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                    up[i, j] = silu_times(acc[i, j], up[i, j])
                T.copy(up, c_s)
            else:
                T.copy(acc, c_s)
            T.copy(c_s, C[by * BLOCK_M, bx * BLOCK_N])
    return gemm_fp8
