import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, shrunk_ptr, stride_x, K: tl.constexpr, RANK: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_R of a row's A(x) in float32 under its adapter's slot of the A table [slots, RANK, K]; zeros for
    slot -1. A program a row and tile of the rank, so a grouped rank (Q/K/V: three adapters' ranks) stays small."""
    row = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + row)
    acc = tl.zeros((BLOCK_R,), tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + (slot * RANK + r[:, None]) * K + k[None, :],
                        mask=(r[:, None] < RANK) & (k[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(shrunk_ptr + row * RANK + r, acc, mask=r < RANK)


@triton.jit
def lora_expand_kernel(shrunk_ptr, b_ptr, scale_ptr, slots_ptr, out_ptr, stride_out, N: tl.constexpr,
                       RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """A row's scale x B(shrunk) for one tile of N outputs, B the slot's [N, RANK], BLOCK_R of the rank at a time;
    zeros for slot -1."""
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    if slot >= 0:
        for r0 in range(0, RANK, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            shrunk = tl.load(shrunk_ptr + row * RANK + r, mask=r < RANK, other=0.0)
            b = tl.load(b_ptr + (slot * N + n[:, None]) * RANK + r[None, :],
                        mask=(n[:, None] < N) & (r[None, :] < RANK), other=0.0).to(tl.float32)
            acc += tl.sum(b * shrunk[None, :], axis=1)
        acc = acc * tl.load(scale_ptr + slot)
    tl.store(out_ptr + row * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)
