"""FP8 helpers that several templates inline (launches.py: a line `# include: fp8.py` becomes this file)."""

import triton
import triton.language as tl


@triton.jit
def widen_e4m3(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """A tile in `dtype`. An e4m3 tile into bf16 comes out times 2^-120 (BF16_LIFT: the caller's scales undo it):
    e4m3's bits moved (sign; exponent and mantissa, 4 places up) in inline PTX, exact for normals and subnormals,
    where Triton's cast takes a quarter-rate F2F an element; PTX because Triton moves no inline assembly past a
    tile's layout change, so the tile crosses shared memory as bf16 (ldmatrix), not as bytes (a byte load each).
    INTERPRETED (Triton's interpreter runs no PTX): the same bits in Triton. Anything else: Triton's cast."""
    if x.dtype == tl.float8e4nv and dtype == tl.bfloat16:
        if INTERPRETED:
            bits = x.to(tl.uint8, bitcast=True).to(tl.uint16)
            out = (((bits & 0x80) << 8) | ((bits & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)
        else:
            out = tl.inline_asm_elementwise(
                "{ .reg .b32 a, b; prmt.b32 a, 0, $2, 0x5040; prmt.b32 b, 0, $2, 0x7060;"
                " lop3.b32 $0, a, 0x80008000, 0, 0xc0; shr.b32 a, a, 4; lop3.b32 $0, a, 0x07F007F0, $0, 0xea;"
                " lop3.b32 $1, b, 0x80008000, 0, 0xc0; shr.b32 b, b, 4; lop3.b32 $1, b, 0x07F007F0, $1, 0xea; }",
                "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=False, pack=4)
    else:
        out = x.to(dtype)
    return out

BF16_LIFT = tl.constexpr(1.329227995784916e36)  # 2^120: what widen_e4m3 leaves out of bf16


@triton.jit
def block_scales(scale_ptr, offs_n, mask_n, k0, N: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
                  SCALE_N: tl.constexpr, SCALE_K: tl.constexpr):
    """The scales of the K tile at k0 (within one block of SCALE_K columns), a column each, and of its up half."""
    blocks: tl.constexpr = (K + SCALE_K - 1) // SCALE_K
    s = tl.load(scale_ptr + (offs_n // SCALE_N) * blocks + k0 // SCALE_K, mask=mask_n, other=0.0)
    s_up = s
    if ACT != 0:
        s_up = tl.load(scale_ptr + ((N + offs_n) // SCALE_N) * blocks + k0 // SCALE_K, mask=mask_n, other=0.0)
    return s, s_up


@triton.jit
def quantize_rows_e4m3(a):
    """Each row of a float32 tile in e4m3 by a scale of its own, its largest magnitude to 448: (values, scales)."""
    amax = tl.max(tl.abs(a), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    return tl.minimum(tl.maximum(a / scale[:, None], -448.0), 448.0).to(tl.float8e4nv), scale


@triton.jit
def tile_scales(scale_ptr, offs_n, mask_n, k0, a_scale, N: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
                SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, A8: tl.constexpr):
    """What a K tile's products are multiplied by (gate's and up's): its weight blocks' scales (SCALE 2) times,
    for W8A8 (A8), each row's own; a column's scale alone (SCALE 1) waits for the finished sums."""
    if SCALE == 2:
        s, s_up = block_scales(scale_ptr, offs_n, mask_n, k0, N, K, ACT, SCALE_N, SCALE_K)
        if A8:
            s, s_up = a_scale[:, None] * s[None, :], a_scale[:, None] * s_up[None, :]
        else:
            s, s_up = s[None, :], s_up[None, :]
    else:
        s, s_up = a_scale[:, None], a_scale[:, None]
    return s, s_up
