"""Mixture of experts for prefill-shaped steps: the (token, choice) pairs grouped by expert, so each expert's weights
are read once a tile of BLOCK_M of its pairs, on the tensor cores, where the per-pair GEMVs of moe.py read them once
a pair. Four launches, all experts in each: moe_sort_kernel lays out, per expert, the pairs it serves padded to
BLOCK_M (-1 pads; an expert with none gets no tile) and a table of the tiles' experts; moe_grouped_gate_up_kernel
and moe_grouped_down_kernel run over those tiles (a program takes every num_programs-th one: the tile count is known
only on the device), writing each pair's row of a float32 scratch; moe_sum_kernel adds each token's K rows in
choice order, so the output never depends on how the pairs were scheduled (no atomics). A node holding some of the
routed experts only (expert parallelism: E from FIRST on) places only their pairs, and the sum skips the others."""

# include: moe.py
# include: dot.py


@triton.jit
def _local_ids(ids_ptr, stride_ids, offs, pairs, K: tl.constexpr, FIRST: tl.constexpr, E: tl.constexpr):
    """The local expert (from FIRST) of each pair index (token * K + choice), and whether it is a pair below `pairs`
    routed to one of the E experts held; 0 where not."""
    local = tl.load(ids_ptr + (offs // K) * stride_ids + offs % K, mask=offs < pairs, other=0) - FIRST
    held = (offs < pairs) & (local >= 0) & (local < E)
    return tl.where(held, local, 0), held


@triton.jit
def moe_sort_kernel(ids_ptr, pairs_ptr, tiles_ptr, M, stride_ids, K: tl.constexpr, BLOCK_E: tl.constexpr,
                    EXPERTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr,
                    FIRST: tl.constexpr, E: tl.constexpr):
    """Every program counts all held experts' pairs (for the offsets), then places the pairs of its own EXPERTS
    experts: expert e's n_e pairs, in pair order, from BLOCK_M x (its first tile), -1 to the end of its last tile.
    tiles_ptr[0] is the number of tiles, tiles_ptr[1 + t] tile t's (local) expert."""
    pairs = M * K
    every = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        local, held = _local_ids(ids_ptr, stride_ids, offs, pairs, K, FIRST, E)
        counts += tl.histogram(local, BLOCK_E, mask=held)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    starts = tl.cumsum(tiles, axis=0) - tiles
    if tl.program_id(0) == 0:
        tl.store(tiles_ptr, tl.sum(tiles, axis=0))
    own = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    pick = every[None, :] == own[:, None]
    own_count = tl.sum(tl.where(pick, counts[None, :], 0), axis=1)
    own_start = tl.sum(tl.where(pick, starts[None, :], 0), axis=1)
    own_tiles = tl.sum(tl.where(pick, tiles[None, :], 0), axis=1)
    for t0 in range(0, tl.max(own_tiles, axis=0), BLOCK_T):  # the tile table's entries of the own experts
        t = t0 + tl.arange(0, BLOCK_T)[None, :]
        tl.store(tiles_ptr + 1 + own_start[:, None] + t, tl.broadcast_to(own[:, None], (EXPERTS, BLOCK_T)),
                 mask=t < own_tiles[:, None])
    last = (own_start + own_tiles - 1)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tl.store(pairs_ptr + last, tl.full([EXPERTS, BLOCK_M], -1, tl.int32),
             mask=(own_tiles[:, None] > 0) & (last >= (own_start * BLOCK_M + own_count)[:, None]))
    placed = own_start * BLOCK_M  # where each own expert's next pair goes
    for p0 in range(0, pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        local, held = _local_ids(ids_ptr, stride_ids, offs, pairs, K, FIRST, E)
        hit = ((local[:, None] == own[None, :]) & held[:, None]).to(tl.int32)
        slot = tl.sum(hit * (tl.cumsum(hit, axis=0) - 1 + placed[None, :]), axis=1)
        tl.store(pairs_ptr + slot, offs, mask=tl.sum(hit, axis=1) > 0)
        placed += tl.sum(hit, axis=0)


@triton.jit
def _tile_pairs(pairs_ptr, tiles_ptr, tile, K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile `tile`'s expert (int64: its weights' offsets pass 2^31), and its rows' tokens, choices and validity."""
    expert = tl.load(tiles_ptr + 1 + tile).to(tl.int64)
    pair = tl.load(pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair >= 0
    pair = tl.where(valid, pair, 0)
    return expert, pair // K, pair % K, valid


@triton.jit
def moe_grouped_gate_up_kernel(x_ptr, w_ptr, scale_ptr, pairs_ptr, tiles_ptr, hidden_ptr, stride_x, stride_hidden,
                               H: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr, ACT: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               UPCAST_DOT: tl.constexpr, FP8: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """hidden[token, choice*INTER + n] = act(gate_e x) * (up_e x) for every pair of each tile's expert e."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    for tile in range(tl.program_id(1), tl.load(tiles_ptr), tl.num_programs(1)):
        expert, token, choice, valid = _tile_pairs(pairs_ptr, tiles_ptr, tile, K, BLOCK_M)
        gate_rows = expert * (2 * INTER) + offs_n
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < H
            a = tl.load(x_ptr + token[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                        other=0.0)
            w_mask = mask_n[:, None] & mask_k[None, :]
            w_gate = expert_tile(w_ptr, scale_ptr, gate_rows, offs_k, w_mask, a, H, INTER, FP8, BR, BC, UPCAST_DOT)
            w_up = expert_tile(w_ptr, scale_ptr, gate_rows + INTER, offs_k, w_mask, a, H, INTER, FP8, BR, BC, UPCAST_DOT)
            gate = _dot(a, tl.trans(w_gate), gate, UPCAST_DOT)
            up = _dot(a, tl.trans(w_up), up, UPCAST_DOT)
        out = (_activate(gate, ACT) * up).to(hidden_ptr.dtype.element_ty)
        tl.store(hidden_ptr + token[:, None] * stride_hidden + choice[:, None] * INTER + offs_n[None, :], out,
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def moe_grouped_down_kernel(hidden_ptr, weights_ptr, w_ptr, scale_ptr, pairs_ptr, tiles_ptr, partial_ptr,
                            stride_hidden, stride_weights, stride_partial, H: tl.constexpr, INTER: tl.constexpr,
                            K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            UPCAST_DOT: tl.constexpr, FP8: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """partial[token, choice*H + n] = weight * down_e(hidden[token, choice]) for every pair of each tile."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    for tile in range(tl.program_id(1), tl.load(tiles_ptr), tl.num_programs(1)):
        expert, token, choice, valid = _tile_pairs(pairs_ptr, tiles_ptr, tile, K, BLOCK_M)
        rows = expert * H + offs_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < INTER
            a = tl.load(hidden_ptr + token[:, None] * stride_hidden + choice[:, None] * INTER + offs_k[None, :],
                        mask=valid[:, None] & mask_k[None, :], other=0.0)
            w = expert_tile(w_ptr, scale_ptr, rows, offs_k, mask_n[:, None] & mask_k[None, :], a, INTER, H, FP8,
                            BR, BC, UPCAST_DOT)
            acc = _dot(a, tl.trans(w), acc, UPCAST_DOT)
        weight = tl.load(weights_ptr + token * stride_weights + choice, mask=valid, other=0.0).to(tl.float32)
        tl.store(partial_ptr + token[:, None] * stride_partial + choice[:, None] * H + offs_n[None, :],
                 acc * weight[:, None], mask=valid[:, None] & mask_n[None, :])


@triton.jit
def moe_sum_kernel(partial_ptr, ids_ptr, out_ptr, stride_partial, stride_ids, stride_out, H: tl.constexpr,
                   K: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr, FIRST: tl.constexpr,
                   E: tl.constexpr):
    """out[token] = the sum of its K rows of partial, in choice order; with PARTIAL (some experts held) of the rows
    of held experts only, the others never written."""
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    out = tl.zeros([BLOCK_N], tl.float32)
    for choice in tl.static_range(K):
        mask = mask_n
        if PARTIAL:
            expert = tl.load(ids_ptr + token * stride_ids + choice) - FIRST
            mask = mask_n & (expert >= 0) & (expert < E)
        out += tl.load(partial_ptr + token * stride_partial + choice * H + offs_n, mask=mask, other=0.0)
    tl.store(out_ptr + token * stride_out + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)
