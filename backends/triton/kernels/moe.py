"""Mixture of experts (layouts: ir/ops/moe.py). Routing: one program per token scores the experts (softmax, or each
one's sigmoid), adds the optional bias to choose by, keeps the TOPK_GROUP best of G groups when grouped, and takes
the K best, weighted by their scores (renormalised when NORMALIZE, times SCALE). The experts are held as a [groups,
experts a group] tile (one group when ungrouped), so no count needs to be a power of two. Experts, the per-expert
GEMV path: one program per (token, choice, column tile) applies the chosen expert's gate/up projection and
activation into a float32 scratch row, then one program per (token, column tile) sums the K down projections, each
times its routing weight. A node holding some of the routed experts only (expert parallelism: E from FIRST on) skips
the pairs routed elsewhere: their loads masked off, their terms zero. Every token reads its experts' weights itself:
right for decode, where a step's tokens seldom share an expert; prefill-shaped steps take moe_grouped.py's grouped
GEMMs instead."""

import triton
import triton.language as tl


@triton.jit
def _scores(logits, valid, SIGMOID: tl.constexpr):
    """Softmax over every valid expert, or each one's sigmoid; 0 where no expert is."""
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        scores = tl.exp(logits - tl.max(logits))
        scores = tl.where(valid, scores, 0.0)
        scores = scores / tl.sum(scores)
    return tl.where(valid, scores, 0.0)


@triton.jit
def _best_groups(choice, G: tl.constexpr, S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr):
    """choice with every expert outside the TOPK_GROUP best groups at -inf: a group scores its best choice, or
    its best two's sum (GROUP_TOP2); ties go to the lower group."""
    members = tl.arange(0, BLOCK_S)[None, :]
    score = tl.max(choice, axis=1)
    if GROUP_TOP2 and S > 1:
        first = tl.min(tl.where(choice == score[:, None], members, BLOCK_S), axis=1)
        score += tl.max(tl.where(members == first[:, None], float("-inf"), choice), axis=1)
    groups = tl.arange(0, BLOCK_G)
    remaining = tl.where(groups < G, score, float("-inf"))
    kept = tl.zeros([BLOCK_G], tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(remaining, axis=0)
        index = tl.min(tl.where(remaining == top, groups, BLOCK_G), axis=0)
        kept = tl.where(groups == index, 1, kept)
        remaining = tl.where(groups == index, float("-inf"), remaining)
    return tl.where(kept[:, None] != 0, choice, float("-inf"))


@triton.jit
def moe_route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_logits, stride_weights, stride_ids,
                     E: tl.constexpr, K: tl.constexpr, G: tl.constexpr, S: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_GROUP: tl.constexpr,
                     GROUP_TOP2: tl.constexpr, SIGMOID: tl.constexpr, NORMALIZE: tl.constexpr,
                     SCALE: tl.constexpr, BIAS: tl.constexpr):
    """ids: the K best choices (descending, ties to the lower expert); weights: their scores, not their choices."""
    row = tl.program_id(0)
    groups, members = tl.arange(0, BLOCK_G)[:, None], tl.arange(0, BLOCK_S)[None, :]
    experts = groups * S + members  # the expert's index, as E = G * S lays them out
    valid = (groups < G) & (members < S)
    logits = tl.load(logits_ptr + row * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    scores = _scores(logits, valid, SIGMOID)
    choice = scores
    if BIAS:
        choice += tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if TOPK_GROUP < G:
        choice = _best_groups(choice, G, S, BLOCK_G, BLOCK_S, TOPK_GROUP, GROUP_TOP2)
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(K):  # the best left, ties to the lower index; -inf marks the taken and the excluded
        best = tl.max(choice)
        index = tl.min(tl.where(choice == best, experts, E))
        chosen = tl.where(slots == j, tl.sum(tl.where(experts == index, scores, 0.0)), chosen)
        ids = tl.where(slots == j, index, ids)
        choice = tl.where(experts == index, float("-inf"), choice)
    if NORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=0)
    if SCALE != 1.0:
        chosen = chosen * SCALE
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
def expert_tile(w_ptr, scale_ptr, rows, offs_k, mask, like, COLS: tl.constexpr, ROWS_PER: tl.constexpr,
                FP8: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, EXACT: tl.constexpr = False):
    """The weights [rows, offs_k] of a stacked expert tensor of COLS columns, in like's dtype; FP8 ones times the
    scale of their block of BR x BC within their own projection of ROWS_PER rows (ir/ops/moe.py's layout), left in
    float32 with EXACT (Triton's CPU interpreter truncates float casts where the GPU rounds)."""
    raw = tl.load(w_ptr + rows[:, None] * COLS + offs_k[None, :], mask=mask, other=0.0)
    if FP8:
        scale_rows = (rows // ROWS_PER) * ((ROWS_PER + BR - 1) // BR) + (rows % ROWS_PER) // BR
        scale = tl.load(scale_ptr + scale_rows[:, None] * ((COLS + BC - 1) // BC) + (offs_k // BC)[None, :],
                        mask=mask, other=0.0)
        if EXACT:
            tile = raw.to(tl.float32) * scale
        else:
            tile = (raw.to(tl.float32) * scale).to(like.dtype)
    else:
        tile = raw.to(like.dtype)
    return tile


@triton.jit
def _held(ids_ptr, index, FIRST: tl.constexpr, E: tl.constexpr):
    """The local expert (int64) of the pair at ids_ptr[index], and whether this node holds it; a pair routed to
    another rank's expert reads expert 0, masked off by the caller."""
    expert = tl.load(ids_ptr + index).to(tl.int64) - FIRST
    held = (expert >= 0) & (expert < E)
    return tl.where(held, expert, 0), held


@triton.jit
def moe_gate_up_kernel(x_ptr, ids_ptr, w_ptr, scale_ptr, hidden_ptr, stride_x, stride_ids, stride_hidden,
                       H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, BR: tl.constexpr,
                       BC: tl.constexpr, FIRST: tl.constexpr, E: tl.constexpr):
    """hidden[token, j*INTER + n] = act(gate_e x) * (up_e x) for the token's j-th expert e; 0 where e is not held."""
    token, choice = tl.program_id(0) // K, tl.program_id(0) % K
    expert, held = _held(ids_ptr, token * stride_ids + choice, FIRST, E)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    gate_rows = expert * (2 * INTER) + offs_n
    gate3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    up3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < H
        a = tl.load(x_ptr + token * stride_x + offs_k, mask=mask_k & held, other=0.0).to(tl.float32)
        w_mask = (mask_n & held)[:, None] & mask_k[None, :]
        gate = expert_tile(w_ptr, scale_ptr, gate_rows, offs_k, w_mask, a, H, INTER, FP8, BR, BC)
        up = expert_tile(w_ptr, scale_ptr, gate_rows + INTER, offs_k, w_mask, a, H, INTER, FP8, BR, BC)
        gate3 += gate * a[None, :]
        up3 += up * a[None, :]
    out = _activate(tl.sum(gate3, axis=1), ACT) * tl.sum(up3, axis=1)
    tl.store(hidden_ptr + token * stride_hidden + choice * INTER + offs_n, out, mask=mask_n)


@triton.jit
def moe_down_kernel(hidden_ptr, weights_ptr, ids_ptr, w_ptr, scale_ptr, out_ptr, stride_hidden, stride_weights,
                    stride_ids, stride_out, H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, BR: tl.constexpr,
                    BC: tl.constexpr, FIRST: tl.constexpr, E: tl.constexpr):
    """out[token] = sum over its K choices of weight * down_e(hidden[token, choice]), of the held experts e."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    out = tl.zeros([BLOCK_N], tl.float32)
    for choice in tl.static_range(K):
        expert, held = _held(ids_ptr, token * stride_ids + choice, FIRST, E)
        weight = tl.load(weights_ptr + token * stride_weights + choice, mask=held, other=0.0).to(tl.float32)
        rows = expert * H + offs_n
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = (offs_k < INTER) & held
            h = tl.load(hidden_ptr + token * stride_hidden + choice * INTER + offs_k, mask=mask_k, other=0.0)
            w = expert_tile(w_ptr, scale_ptr, rows, offs_k, mask_n[:, None] & mask_k[None, :], h, INTER, H, FP8,
                            BR, BC)
            acc3 += w * h[None, :]
        out += weight * tl.sum(acc3, axis=1)
    tl.store(out_ptr + token * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)
