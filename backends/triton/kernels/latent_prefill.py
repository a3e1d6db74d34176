"""Latent attention for prompt chunks: a program per (sequence, head tile, query tile, value chunk) of 64 rows
(queries x heads). Its scores take the whole latent and the rope key, read BLOCK_C values at a time as the dot
wants them; its values are its own BLOCK_V of the latent, so its accumulator is [64, BLOCK_V] where a [64, L] one
would spill. The scores are recomputed for each of the L / BLOCK_V chunks: more tensor-core work, for wgmma tiles
of 64 rows where the decode kernel's are 16 at 16 heads, and so a quarter of its cache reads."""

# include: latent_attention.py


@triton.jit
def _chunked_scores(q_ptr, q_rope, cache_ptr, addr, pos_ok, token, head, row_ok, stride_q, HEAD_Q: tl.constexpr,
                    L: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_KV: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """q . latent + q_rope . rope key for the tile's rows against BLOCK_KV cached rows at `addr`."""
    scores = tl.zeros([ROWS, BLOCK_KV], tl.float32)
    q_rows = q_ptr + token.to(tl.int64)[:, None] * stride_q + head[:, None] * HEAD_Q
    for c0 in tl.static_range(0, L, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        q = tl.load(q_rows + offs[None, :], mask=row_ok[:, None] & (offs < L)[None, :], other=0.0)
        k = tl.load(cache_ptr + addr[:, None] + offs[None, :], mask=pos_ok[:, None] & (offs < L)[None, :],
                    other=0.0)
        scores = _dot(q, tl.trans(k), scores, UPCAST_DOT)
    offs_r = tl.arange(0, BLOCK_R)
    rope = tl.load(cache_ptr + addr[:, None] + L + offs_r[None, :], mask=pos_ok[:, None] & (offs_r < R)[None, :],
                   other=0.0)
    return _dot(q_rope, tl.trans(rope), scores, UPCAST_DOT)


@triton.jit
def latent_prefill_kernel(q_ptr, q_rope_ptr, cache_ptr, tables_ptr, starts_ptr, q_lens_ptr, ctx_lens_ptr, out_ptr,
                          stride_q, stride_rope, stride_out, stride_tables, SCALE: tl.constexpr,
                          HEADS: tl.constexpr, L: tl.constexpr, R: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
                          CHUNKS: tl.constexpr, HEAD_Q: tl.constexpr, HEAD_ROPE: tl.constexpr,
                          HEAD_OUT: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Program (sequence, head tile, query tile x CHUNKS + value chunk): the online softmax over the causally
    visible cached rows, gathered through the block table, into the chunk's columns of the output."""
    seq, head_tile = tl.program_id(0), tl.program_id(1)
    q_tile = tl.num_programs(2) // CHUNKS - 1 - tl.program_id(2) // CHUNKS  # the longest tiles first
    offs_v = (tl.program_id(2) % CHUNKS) * BLOCK_V + tl.arange(0, BLOCK_V)
    start = tl.load(starts_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    ctx = tl.load(ctx_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    q_index = q_tile * BLOCK_Q + rows // BLOCK_H
    head = head_tile * BLOCK_H + rows % BLOCK_H
    row_ok = (q_index < q_len) & (head < HEADS)
    token = start + q_index
    q_pos = ctx - q_len + q_index
    kv_end = tl.minimum(ctx, ctx - q_len + (q_tile + 1) * BLOCK_Q)
    kv_end = tl.where(q_tile * BLOCK_Q < q_len, kv_end, 0)
    q_rope = _rows(q_rope_ptr, token, head, row_ok, stride_rope, HEAD_ROPE, R, BLOCK_R)
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_V], tl.float32)
    for kv_start in range(0, kv_end, BLOCK_KV):
        pos = kv_start + tl.arange(0, BLOCK_KV)
        pos_ok = pos < kv_end
        block = tl.load(tables_ptr + seq * stride_tables + pos // CACHE_BLOCK, mask=pos_ok, other=0)
        addr = (block.to(tl.int64) * CACHE_BLOCK + pos % CACHE_BLOCK) * (L + R)
        scores = _chunked_scores(q_ptr, q_rope, cache_ptr, addr, pos_ok, token, head, row_ok, stride_q, HEAD_Q, L,
                                 R, BLOCK_C, BLOCK_R, BLOCK_Q * BLOCK_H, BLOCK_KV, UPCAST_DOT) * SCALE
        scores = tl.where((pos[None, :] <= q_pos[:, None]) & pos_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet stay at zero
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        values = tl.load(cache_ptr + addr[:, None] + offs_v[None, :], mask=pos_ok[:, None] & (offs_v < L)[None, :],
                         other=0.0)
        acc = _dot(p.to(values.dtype), values, acc * alpha[:, None], UPCAST_DOT)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token.to(tl.int64)[:, None] * stride_out + head[:, None] * HEAD_OUT + offs_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_v < L)[None, :])
