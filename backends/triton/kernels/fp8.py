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
