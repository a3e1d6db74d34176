"""Mixture of experts (layouts: ir/ops/moe.py). Routing: one program per token takes the softmax over the experts
and the K most probable, renormalised when NORMALIZE. Experts, the per-expert GEMV path: one program per (token,
choice, column tile) applies the chosen expert's gate/up projection and activation into a float32 scratch row,
then one program per (token, column tile) sums the K down projections, each times its routing weight. Every
token reads its experts' weights itself: right for decode, where a step's tokens seldom share an expert; a grouped
GEMM that batches the tokens of each expert on the tensor cores is what prefill would want next."""

import triton
import triton.language as tl


@triton.jit
def moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_logits, stride_weights, stride_ids,
                     E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                     NORMALIZE: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    logits = tl.load(logits_ptr + row * stride_logits + offs, mask=mask, other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(mask, probs, 0.0)
    probs = probs / tl.sum(probs, axis=0)
    remaining = tl.where(mask, probs, -1.0)
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(K):  # the largest left, ties to the lower index
        best = tl.max(remaining, axis=0)
        index = tl.min(tl.where(remaining == best, offs, BLOCK_E), axis=0)
        chosen = tl.where(slots == j, best, chosen)
        ids = tl.where(slots == j, index, ids)
        remaining = tl.where(offs == index, -1.0, remaining)
    if NORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=0)
    keep = slots < K
    tl.store(weights_ptr + row * stride_weights + slots, chosen.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + row * stride_ids + slots, ids, mask=keep)


@triton.jit
def _activate(gate, ACT: tl.constexpr):
    if ACT == 1:  # silu
        out = gate / (1.0 + tl.exp(-gate))
    else:  # gelu with the tanh approximation
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        out = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    return out


@triton.jit
def moe_gate_up_kernel(x_ptr, ids_ptr, w_ptr, hidden_ptr, stride_x, stride_ids, stride_hidden,
                       H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """hidden[token, j*INTER + n] = act(gate_e x) * (up_e x) for the token's j-th expert e."""
    token, choice = tl.program_id(0) // K, tl.program_id(0) % K
    expert = tl.load(ids_ptr + token * stride_ids + choice).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    gate_rows = expert * (2 * INTER) + offs_n
    gate3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < H
        a = tl.load(x_ptr + token * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w_mask = mask_n[:, None] & mask_k[None, :]
        gate = tl.load(w_ptr + gate_rows[:, None] * H + offs_k[None, :], mask=w_mask, other=0.0)
        up = tl.load(w_ptr + (gate_rows + INTER)[:, None] * H + offs_k[None, :], mask=w_mask, other=0.0)
        gate3 += gate.to(tl.float32) * a[None, :]
        up3 += up.to(tl.float32) * a[None, :]
    out = _activate(tl.sum(gate3, axis=1), ACT) * tl.sum(up3, axis=1)
    tl.store(hidden_ptr + token * stride_hidden + choice * INTER + offs_n, out, mask=mask_n)


@triton.jit
def moe_down_kernel(hidden_ptr, weights_ptr, ids_ptr, w_ptr, out_ptr, stride_hidden, stride_weights, stride_ids,
                    stride_out, H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """out[token] = sum over its K choices of weight * down_e(hidden[token, choice])."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    out = tl.zeros([BLOCK_N], tl.float32)
    for choice in tl.static_range(K):
        expert = tl.load(ids_ptr + token * stride_ids + choice).to(tl.int64)
        weight = tl.load(weights_ptr + token * stride_weights + choice).to(tl.float32)
        rows = expert * H + offs_n
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < INTER
            h = tl.load(hidden_ptr + token * stride_hidden + choice * INTER + offs_k, mask=mask_k, other=0.0)
            w = tl.load(w_ptr + rows[:, None] * INTER + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                        other=0.0)
            acc3 += w.to(tl.float32) * h[None, :]
        out += weight * tl.sum(acc3, axis=1)
    tl.store(out_ptr + token * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)
