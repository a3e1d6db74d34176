"""Latent attention over a latent cache [blocks, block_size, 1, L + R] (layouts: ir/ops/latent_attention.py): the
cache write, the attention of every query head against the one latent head (heads x keys fill the tensor-core
tile, since all heads share the cached row), and the per-head GEMM that folds queries into, and outputs out of,
the latent space. Rows of [tokens, heads, D] tensors sit `stride` apart, heads a static HEAD_* apart within (a
split view's heads keep its source's)."""

import triton
import triton.language as tl

# include: dot.py


@triton.jit
def latent_write_kernel(cache_ptr, latent_ptr, rope_ptr, slots_ptr, stride_latent, stride_rope, L: tl.constexpr,
                        R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program per token: its latent then its rope key into the cache row at its slot; padding (-1) skips."""
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        row = cache_ptr + slot * (L + R)
        for c in tl.static_range(0, L, BLOCK_L):
            offs = c + tl.arange(0, BLOCK_L)
            values = tl.load(latent_ptr + token * stride_latent + offs, mask=offs < L)
            tl.store(row + offs, values.to(cache_ptr.dtype.element_ty), mask=offs < L)
        offs_r = tl.arange(0, BLOCK_R)
        rope = tl.load(rope_ptr + token * stride_rope + offs_r, mask=offs_r < R)
        tl.store(row + L + offs_r, rope.to(cache_ptr.dtype.element_ty), mask=offs_r < R)


@triton.jit
def _rows(ptr, token, head, row_ok, stride, HEAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The tile's rows (a token's head each) of a [tokens, heads, D] tensor, zero outside it."""
    offs = tl.arange(0, BLOCK_D)
    return tl.load(ptr + token.to(tl.int64)[:, None] * stride + head[:, None] * HEAD + offs[None, :],
                   mask=row_ok[:, None] & (offs < D)[None, :], other=0.0)


@triton.jit
def _latent_tile(q, q_rope, cache_ptr, tables_ptr, stride_tables, seq, q_pos, kv_start, kv_end, acc, m_i, l_i,
                 SCALE: tl.constexpr, L: tl.constexpr, R: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr, BLOCK_KV: tl.constexpr,
                 UPCAST_DOT: tl.constexpr):
    """One tile of cached rows into the online softmax: scores from the latent and the rope key, values the
    latent (read once for both dots)."""
    pos = kv_start + tl.arange(0, BLOCK_KV)
    pos_ok = pos < kv_end
    block = tl.load(tables_ptr + seq * stride_tables + pos // CACHE_BLOCK, mask=pos_ok, other=0)
    addr = (block.to(tl.int64) * CACHE_BLOCK + pos % CACHE_BLOCK) * (L + R)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    latent = tl.load(cache_ptr + addr[:, None] + offs_l[None, :], mask=pos_ok[:, None] & (offs_l < L)[None, :],
                     other=0.0)
    rope = tl.load(cache_ptr + addr[:, None] + L + offs_r[None, :], mask=pos_ok[:, None] & (offs_r < R)[None, :],
                   other=0.0)
    scores = _dot(q, tl.trans(latent), tl.zeros([ROWS, BLOCK_KV], tl.float32), UPCAST_DOT)
    scores = _dot(q_rope, tl.trans(rope), scores, UPCAST_DOT) * SCALE
    visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet stay at zero
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _dot(p.to(latent.dtype), latent, acc * alpha[:, None], UPCAST_DOT)
    return acc, m_new, l_i


@triton.jit
def latent_attention_kernel(q_ptr, q_rope_ptr, cache_ptr, tables_ptr, starts_ptr, q_lens_ptr, ctx_lens_ptr,
                            out_ptr, stride_q, stride_rope, stride_out, stride_tables, SCALE: tl.constexpr,
                            HEADS: tl.constexpr, L: tl.constexpr, R: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                            BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, HEAD_Q: tl.constexpr,
                            HEAD_ROPE: tl.constexpr, HEAD_OUT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """A program per (sequence, head tile, query tile): BLOCK_Q queries times BLOCK_H heads, one online softmax
    over the causally visible cached rows gathered through the block table."""
    # the last query tiles (the most keys under the causal mask) first, so that no long tile starts last
    seq, head_tile, q_tile = tl.program_id(0), tl.program_id(1), tl.num_programs(2) - 1 - tl.program_id(2)
    start = tl.load(starts_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    ctx = tl.load(ctx_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    q_index = q_tile * BLOCK_Q + rows // BLOCK_H
    head = head_tile * BLOCK_H + rows % BLOCK_H
    row_ok = (q_index < q_len) & (head < HEADS)
    token = start + q_index
    q_pos = ctx - q_len + q_index
    kv_end = tl.minimum(ctx, ctx - q_len + (q_tile + 1) * BLOCK_Q)  # the last query of the tile sees this far
    kv_end = tl.where(q_tile * BLOCK_Q < q_len, kv_end, 0)  # a tile past the sequence's queries reads no keys
    q = _rows(q_ptr, token, head, row_ok, stride_q, HEAD_Q, L, BLOCK_L)
    q_rope = _rows(q_rope_ptr, token, head, row_ok, stride_rope, HEAD_ROPE, R, BLOCK_R)
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_L], tl.float32)
    for kv_start in range(0, kv_end, BLOCK_KV):
        acc, m_i, l_i = _latent_tile(q, q_rope, cache_ptr, tables_ptr, stride_tables, seq, q_pos, kv_start, kv_end,
                                     acc, m_i, l_i, SCALE, L, R, CACHE_BLOCK, BLOCK_L, BLOCK_R, BLOCK_Q * BLOCK_H,
                                     BLOCK_KV, UPCAST_DOT)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    offs_l = tl.arange(0, BLOCK_L)
    tl.store(out_ptr + token.to(tl.int64)[:, None] * stride_out + head[:, None] * HEAD_OUT + offs_l[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_l < L)[None, :])


@triton.jit
def head_linear_kernel(x_ptr, w_ptr, out_ptr, M, stride_x, stride_out, HEADS: tl.constexpr, N: tl.constexpr,
                       K: tl.constexpr, TRANSPOSED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, HEAD_X: tl.constexpr, HEAD_OUT: tl.constexpr,
                       UPCAST_DOT: tl.constexpr):
    """A program per (row tile, head, column tile) of out[:, h] = x[:, h] @ w_h: w_h the head's block of w's rows,
    [K, N] when TRANSPOSED, else [N, K] (a linear's weight, used transposed)."""
    row_tile, head, col_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    if TRANSPOSED:
        stride_wk, stride_wn = N, 1
    else:
        stride_wk, stride_wn = 1, K
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x + head * HEAD_X
    w_head = w_ptr + head.to(tl.int64) * N * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_head + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(x, w.to(x.dtype), acc, UPCAST_DOT)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_out + head * HEAD_OUT + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _inv_freq(i, ROT: tl.constexpr, THETA: tl.constexpr, SCALING: tl.constexpr, FACTOR: tl.constexpr,
              LOW: tl.constexpr, HIGH: tl.constexpr, ORIGINAL: tl.constexpr):
    """ir/ops/attention.py's rope_inv_freq of pair i: SCALING 0 none, 1 linear, 2 by_wavelength, 3 yarn."""
    inv_freq = 1.0 / tl.exp2((2.0 * i.to(tl.float32) / ROT) * tl.log2(THETA))
    if SCALING == 1:
        inv_freq = inv_freq / FACTOR
    elif SCALING == 2:
        wavelen = 6.283185307179586 / inv_freq
        scaled = tl.where(wavelen > ORIGINAL / LOW, inv_freq / FACTOR, inv_freq)
        smooth = (ORIGINAL / wavelen - LOW) / (HIGH - LOW)
        medium = (wavelen >= ORIGINAL / HIGH) & (wavelen <= ORIGINAL / LOW)
        inv_freq = tl.where(medium, (1.0 - smooth) * scaled / FACTOR + smooth * scaled, scaled)
    elif SCALING == 3:
        ramp = tl.minimum(tl.maximum((i.to(tl.float32) - LOW) / (HIGH - LOW), 0.0), 1.0)
        inv_freq = inv_freq / FACTOR * ramp + inv_freq * (1.0 - ramp)
    return inv_freq


@triton.jit
def rope_rows_kernel(x_ptr, pos_ptr, out_ptr, stride_x, stride_out, HEADS: tl.constexpr, D: tl.constexpr,
                     ROT: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     BLOCK_REST: tl.constexpr, THETA: tl.constexpr, SCALING: tl.constexpr, FACTOR: tl.constexpr,
                     LOW: tl.constexpr, HIGH: tl.constexpr, ORIGINAL: tl.constexpr, MAGNITUDE: tl.constexpr,
                     HEAD_X: tl.constexpr, HEAD_OUT: tl.constexpr):
    """A program per token: a standalone rope of every head's first ROT dims (the latent attention's rope parts,
    which no cache write follows); INTERLEAVED pairs dims 2i and 2i + 1, else i and i + ROT / 2. MAGNITUDE: yarn's
    attention factor on cos and sin."""
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    ok = (heads < HEADS)[:, None] & (i < ROT // 2)[None, :]
    angle = pos * _inv_freq(i, ROT, THETA, SCALING, FACTOR, LOW, HIGH, ORIGINAL)
    cos, sin = (tl.cos(angle) * MAGNITUDE)[None, :], (tl.sin(angle) * MAGNITUDE)[None, :]
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + ROT // 2
    x_row = x_ptr + token.to(tl.int64) * stride_x + heads[:, None] * HEAD_X
    out_row = out_ptr + token.to(tl.int64) * stride_out + heads[:, None] * HEAD_OUT
    x1 = tl.load(x_row + first[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_row + first[None, :], (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_row + second[None, :], (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=ok)
    if ROT < D:  # a partial rotary passes the rest through
        rest = ROT + tl.arange(0, BLOCK_REST)
        rest_ok = (heads < HEADS)[:, None] & (rest < D)[None, :]
        tl.store(out_row + rest[None, :], tl.load(x_row + rest[None, :], mask=rest_ok), mask=rest_ok)
