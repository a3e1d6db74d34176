"""Per-head q/k RMSNorm + RoPE + the paged KV write, and grouped-query causal attention over the paged cache
(layouts: ir/ops/attention.py). One program per (token, head) for the first; per (sequence, kv head, query tile)
for attention, which keeps an online softmax over key tiles gathered through the block table. A sliding WINDOW
(0: none) masks keys more than WINDOW - 1 positions behind a query, and skips the tiles no query of a program sees.
RoPE frequencies follow ir/ops/attention.py's rope_inv_freq: SCALING 0 none, 1 linear, 2 by_wavelength."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _inv_freq(offs, HD: tl.constexpr, THETA: tl.constexpr, SCALING: tl.constexpr, FACTOR: tl.constexpr,
              LOW_FREQ: tl.constexpr, HIGH_FREQ: tl.constexpr, ORIGINAL: tl.constexpr):
    inv_freq = 1.0 / tl.exp2((2.0 * offs.to(tl.float32) / HD) * tl.log2(THETA))
    if SCALING == 1:
        inv_freq = inv_freq / FACTOR
    elif SCALING == 2:
        wavelen = 6.283185307179586 / inv_freq
        scaled = tl.where(wavelen > ORIGINAL / LOW_FREQ, inv_freq / FACTOR, inv_freq)
        smooth = (ORIGINAL / wavelen - LOW_FREQ) / (HIGH_FREQ - LOW_FREQ)
        medium = (wavelen >= ORIGINAL / HIGH_FREQ) & (wavelen <= ORIGINAL / LOW_FREQ)
        inv_freq = tl.where(medium, (1.0 - smooth) * scaled / FACTOR + smooth * scaled, scaled)
    return inv_freq


@triton.jit
def _rotation(pos, offs, HD: tl.constexpr, THETA: tl.constexpr, SCALING: tl.constexpr, FACTOR: tl.constexpr,
              LOW_FREQ: tl.constexpr, HIGH_FREQ: tl.constexpr, ORIGINAL: tl.constexpr):
    """RoPE's cos and sin at position `pos` for the first half's offsets."""
    angle = pos * _inv_freq(offs, HD, THETA, SCALING, FACTOR, LOW_FREQ, HIGH_FREQ, ORIGINAL)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _norm_rotate(x_ptr, w1, w2, cos, sin, offs, mask, HD: tl.constexpr, EPS: tl.constexpr, NORM: tl.constexpr):
    """A head's RMSNorm (weight halves w1, w2, offset included) and rotation."""
    half: tl.constexpr = HD // 2
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    return _norm_rotate_halves(x1, x2, w1, w2, cos, sin, HD, EPS, NORM, 0)


@triton.jit
def _norm_rotate_halves(x1, x2, w1, w2, cos, sin, HD: tl.constexpr, EPS: tl.constexpr, NORM: tl.constexpr,
                        AXIS: tl.constexpr):
    """The RMSNorm and rotation of heads' halves x1, x2 (float32; a head along AXIS: one head, or a tile of them)."""
    if NORM:
        squares = tl.sum(x1 * x1, axis=AXIS, keep_dims=True) + tl.sum(x2 * x2, axis=AXIS, keep_dims=True)
        rstd = 1.0 / tl.sqrt(squares / HD + EPS)
        x1 = x1 * rstd * w1
        x2 = x2 * rstd * w2
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """As gemm.dot: float32 products under the CPU interpreter, whose bf16 dot is wrong in Triton 3.6."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def qk_rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, slot_ptr, q_out_ptr,
                            k_cache_ptr, v_cache_ptr, stride_q, stride_k, stride_v, stride_q_out,
                            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr, EPS: tl.constexpr,
                            NORM: tl.constexpr, NORM_OFFSET: tl.constexpr, THETA: tl.constexpr,
                            SCALING: tl.constexpr, FACTOR: tl.constexpr, LOW_FREQ: tl.constexpr,
                            HIGH_FREQ: tl.constexpr, ORIGINAL: tl.constexpr, BLOCK_HALF: tl.constexpr,
                            PDL: tl.constexpr, EARLY: tl.constexpr):
    """EARLY (positions and slots are step inputs, uploaded before the step): the position, the slot, the norm's
    weights and the rotation's cos and sin come before the wait for the previous kernel, whose output is only the
    heads."""
    if PDL:  # programmatic dependent launch: the next kernel may start at once
        gdc_launch_dependents()
        if not EARLY:
            gdc_wait()
    token = tl.program_id(0)
    head = tl.program_id(1)
    half: tl.constexpr = HD // 2
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    cos, sin = _rotation(tl.load(pos_ptr + token).to(tl.float32), offs, HD, THETA, SCALING, FACTOR, LOW_FREQ,
                         HIGH_FREQ, ORIGINAL)
    w1, w2 = 0.0, 0.0
    if NORM:
        w_ptr = tl.where(head < HEADS, q_norm_ptr, k_norm_ptr)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + NORM_OFFSET
        w2 = tl.load(w_ptr + half + offs, mask=mask, other=0.0).to(tl.float32) + NORM_OFFSET
    slot = tl.load(slot_ptr + token)
    if PDL and EARLY:
        gdc_wait()
    if head < HEADS:
        o1, o2 = _norm_rotate(q_ptr + token * stride_q + head * HD, w1, w2, cos, sin, offs, mask, HD, EPS, NORM)
        q_dst = q_out_ptr + token * stride_q_out + head * HD
        tl.store(q_dst + offs, o1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_dst + half + offs, o2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kv_head = head - HEADS
        write = mask & (slot >= 0)
        o1, o2 = _norm_rotate(k_ptr + token * stride_k + kv_head * HD, w1, w2, cos, sin, offs, mask, HD, EPS, NORM)
        cache_offset = (slot.to(tl.int64) * KV_HEADS + kv_head) * HD
        tl.store(k_cache_ptr + cache_offset + offs, o1.to(k_cache_ptr.dtype.element_ty), mask=write)
        tl.store(k_cache_ptr + cache_offset + half + offs, o2.to(k_cache_ptr.dtype.element_ty), mask=write)
        src = v_ptr + token * stride_v + kv_head * HD
        v1 = tl.load(src + offs, mask=mask, other=0.0)
        v2 = tl.load(src + half + offs, mask=mask, other=0.0)
        tl.store(v_cache_ptr + cache_offset + offs, v1.to(v_cache_ptr.dtype.element_ty), mask=write)
        tl.store(v_cache_ptr + cache_offset + half + offs, v2.to(v_cache_ptr.dtype.element_ty), mask=write)


@triton.jit
def qk_rope_kv_write_rows_kernel(q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, slot_ptr, q_out_ptr,
                                 k_cache_ptr, v_cache_ptr, stride_q, stride_k, stride_v, stride_q_out,
                                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr, EPS: tl.constexpr,
                                 NORM: tl.constexpr, NORM_OFFSET: tl.constexpr, THETA: tl.constexpr,
                                 SCALING: tl.constexpr, FACTOR: tl.constexpr, LOW_FREQ: tl.constexpr,
                                 HIGH_FREQ: tl.constexpr, ORIGINAL: tl.constexpr, BLOCK_HALF: tl.constexpr,
                                 BLOCK_HEADS: tl.constexpr):
    """qk_rope_kv_write_kernel for prompt chunks: one program per token holding all of its heads (q's, then k's)
    as the rows of a [BLOCK_HEADS, BLOCK_HALF] tile, so the rotation's cos and sin are computed once a token."""
    token = tl.program_id(0)
    half: tl.constexpr = HD // 2
    offs = tl.arange(0, BLOCK_HALF)
    rows = tl.arange(0, BLOCK_HEADS)
    col_ok = (offs < half)[None, :]
    is_q = (rows < HEADS)[:, None]
    is_k = ((rows >= HEADS) & (rows < HEADS + KV_HEADS))[:, None]
    q_head = tl.where(is_q, rows[:, None], 0)
    kv_head = tl.where(is_k, rows[:, None] - HEADS, 0)
    cos, sin = _rotation(tl.load(pos_ptr + token).to(tl.float32), offs, HD, THETA, SCALING, FACTOR, LOW_FREQ,
                         HIGH_FREQ, ORIGINAL)
    src = tl.where(is_q, q_ptr + token * stride_q + q_head * HD, k_ptr + token * stride_k + kv_head * HD)
    ok = (is_q | is_k) & col_ok
    x1 = tl.load(src + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    w1, w2 = 0.0, 0.0
    if NORM:
        mask = offs < half
        w1 = tl.where(is_q, tl.load(q_norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)[None, :],
                      tl.load(k_norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)[None, :]) + NORM_OFFSET
        w2 = tl.where(is_q, tl.load(q_norm_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)[None, :],
                      tl.load(k_norm_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)[None, :]) + NORM_OFFSET
    o1, o2 = _norm_rotate_halves(x1, x2, w1, w2, cos[None, :], sin[None, :], HD, EPS, NORM, 1)
    q_dst = q_out_ptr + token * stride_q_out + q_head * HD + offs[None, :]
    tl.store(q_dst, o1.to(q_out_ptr.dtype.element_ty), mask=is_q & col_ok)
    tl.store(q_dst + half, o2.to(q_out_ptr.dtype.element_ty), mask=is_q & col_ok)
    slot = tl.load(slot_ptr + token)
    write = is_k & col_ok & (slot >= 0)
    cache = (slot.to(tl.int64) * KV_HEADS + kv_head) * HD + offs[None, :]
    tl.store(k_cache_ptr + cache, o1.to(k_cache_ptr.dtype.element_ty), mask=write)
    tl.store(k_cache_ptr + cache + half, o2.to(k_cache_ptr.dtype.element_ty), mask=write)
    v_src = v_ptr + token * stride_v + kv_head * HD + offs[None, :]
    v1 = tl.load(v_src, mask=is_k & col_ok, other=0.0)
    v2 = tl.load(v_src + half, mask=is_k & col_ok, other=0.0)
    tl.store(v_cache_ptr + cache, v1.to(v_cache_ptr.dtype.element_ty), mask=write)
    tl.store(v_cache_ptr + cache + half, v2.to(v_cache_ptr.dtype.element_ty), mask=write)


@triton.jit
def _query_rows(starts_ptr, q_lens_ptr, ctx_lens_ptr, seq, kv_head, q_tile, GROUP: tl.constexpr,
                GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, WINDOW: tl.constexpr):
    """The tile's rows: BLOCK_Q queries of the sequence times the GROUP heads sharing this KV head (their tokens,
    heads, validity and positions); the keys the tile's queries see, kv_begin .. kv_end; and `fresh`, the step's
    first position, before which every key was written by an earlier step. Step inputs only."""
    start = tl.load(starts_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    ctx = tl.load(ctx_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    q_index = q_tile * BLOCK_Q + rows // GROUP_P2
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (q_index < q_len) & (rows % GROUP_P2 < GROUP)
    kv_end = tl.minimum(ctx, ctx - q_len + (q_tile + 1) * BLOCK_Q)  # the last query of the tile sees this far
    kv_begin = 0
    if WINDOW > 0:  # the first query of the tile sees back to here
        kv_begin = tl.maximum(ctx - q_len + q_tile * BLOCK_Q - WINDOW + 1, 0)
    # A tile past the sequence's queries (the grid covers the step's longest query) reads no keys: a decode row
    # beside a long prompt chunk would otherwise walk its whole context once per empty tile.
    kv_end = tl.where(q_tile * BLOCK_Q < q_len, kv_end, kv_begin)
    return start + q_index, head, row_ok, ctx - q_len + q_index, kv_begin, kv_end, ctx - q_len


@triton.jit
def _heads(ptr, token, head, row_ok, stride, HD: tl.constexpr, BLOCK_D: tl.constexpr):
    """The tile's query rows of q (or any [tokens, heads * HD] tensor)."""
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(ptr + token[:, None] * stride + head[:, None] * HD + offs_d[None, :],
                   mask=row_ok[:, None] & (offs_d < HD)[None, :], other=0.0)


@triton.jit
def _gather(cache_ptr, addr, ok, HD: tl.constexpr, BLOCK_D: tl.constexpr):
    """The rows of a key (or value) tile at the cache offsets `addr`, zero where not `ok`."""
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(cache_ptr + addr[:, None] + offs_d[None, :], mask=ok[:, None] & (offs_d < HD)[None, :], other=0.0)


@triton.jit
def _addresses(tables_ptr, stride_tables, seq, kv_head, pos, pos_ok, KV_HEADS: tl.constexpr, HD: tl.constexpr,
               CACHE_BLOCK: tl.constexpr):
    """The cache offsets of positions `pos` of the sequence's keys for this KV head, through its block table."""
    block = tl.load(tables_ptr + seq * stride_tables + pos // CACHE_BLOCK, mask=pos_ok, other=0)
    return ((block.to(tl.int64) * CACHE_BLOCK + pos % CACHE_BLOCK) * KV_HEADS + kv_head) * HD


@triton.jit
def _softmax_tile(q, q_pos, k, v, pos, pos_ok, acc, m_i, l_i, SCALE: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_KV: tl.constexpr, WINDOW: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One tile of keys and values into the online softmax's (unnormalised out, max, sum)."""
    scores = _dot(q, tl.trans(k), tl.zeros([ROWS, BLOCK_KV], tl.float32), UPCAST_DOT) * SCALE
    visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
    if WINDOW > 0:
        visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet stay at zero
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_DOT)
    return acc, m_new, l_i


@triton.jit
def _attend(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, stride_q, stride_tables, seq, kv_head, token, head, row_ok,
            q_pos, lo, hi, fresh, SCALE: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr,
            CACHE_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, BLOCK_KV: tl.constexpr,
            WINDOW: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
            PREFETCH: tl.constexpr):
    """Online softmax over the keys lo .. hi, gathered through the block table: (unnormalised out, max, sum).
    PREFETCH (EARLY: the step inputs come from the upload, not from a kernel): the first tile's keys and values
    before `fresh` (written by earlier steps) are read before the wait for the previous kernel, this step's
    after it with the queries. They stay in registers across the wait (71 more a thread: 3 programs an SM where
    5 fit), which pays only while the step's programs fit one wave; an L2 prefetch instead gained nothing."""
    tl.static_assert(EARLY or not PREFETCH, "PREFETCH reads keys before the wait: only with EARLY step inputs")
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    first = lo
    if PREFETCH:
        pos = lo + tl.arange(0, BLOCK_KV)
        pos_ok = pos < hi
        addr = _addresses(tables_ptr, stride_tables, seq, kv_head, pos, pos_ok, KV_HEADS, HD, CACHE_BLOCK)
        old = pos_ok & (pos < fresh)
        k = _gather(k_cache_ptr, addr, old, HD, BLOCK_D)
        v = _gather(v_cache_ptr, addr, old, HD, BLOCK_D)
        if PDL:
            gdc_wait()
        q = _heads(q_ptr, token, head, row_ok, stride_q, HD, BLOCK_D)
        new = pos_ok & (pos >= fresh)
        k = tl.where(new[:, None], _gather(k_cache_ptr, addr, new, HD, BLOCK_D), k)
        v = tl.where(new[:, None], _gather(v_cache_ptr, addr, new, HD, BLOCK_D), v)
        acc, m_i, l_i = _softmax_tile(q, q_pos, k, v, pos, pos_ok, acc, m_i, l_i, SCALE, ROWS, BLOCK_KV, WINDOW,
                                      UPCAST_DOT)
        first = lo + BLOCK_KV
    else:
        if PDL and EARLY:
            gdc_wait()
        q = _heads(q_ptr, token, head, row_ok, stride_q, HD, BLOCK_D)
    for kv_start in range(first, hi, BLOCK_KV):
        pos = kv_start + tl.arange(0, BLOCK_KV)
        pos_ok = pos < hi
        addr = _addresses(tables_ptr, stride_tables, seq, kv_head, pos, pos_ok, KV_HEADS, HD, CACHE_BLOCK)
        k = _gather(k_cache_ptr, addr, pos_ok, HD, BLOCK_D)
        v = _gather(v_cache_ptr, addr, pos_ok, HD, BLOCK_D)
        acc, m_i, l_i = _softmax_tile(q, q_pos, k, v, pos, pos_ok, acc, m_i, l_i, SCALE, ROWS, BLOCK_KV, WINDOW,
                                      UPCAST_DOT)
    return acc, m_i, l_i


@triton.jit
def paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, starts_ptr, q_lens_ptr, ctx_lens_ptr,
                           out_ptr, stride_q, stride_out, stride_tables,
                           SCALE: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr,
                           CACHE_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_P2: tl.constexpr,
                           BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, WINDOW: tl.constexpr,
                           UPCAST_DOT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                           PREFETCH: tl.constexpr):
    if PDL:  # programmatic dependent launch: the next kernel may start at once; EARLY waits in _attend
        gdc_launch_dependents()
        if not EARLY:
            gdc_wait()
    # the last query tiles (the most keys under the causal mask) first, so that no long tile starts last
    seq, kv_head, q_tile = tl.program_id(0), tl.program_id(1), tl.num_programs(2) - 1 - tl.program_id(2)
    token, head, row_ok, q_pos, kv_begin, kv_end, fresh = _query_rows(
        starts_ptr, q_lens_ptr, ctx_lens_ptr, seq, kv_head, q_tile, GROUP, GROUP_P2, BLOCK_Q, WINDOW)
    acc, m_i, l_i = _attend(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, stride_q, stride_tables, seq, kv_head,
                            token, head, row_ok, q_pos, kv_begin, kv_end, fresh, SCALE, KV_HEADS, HD, CACHE_BLOCK,
                            BLOCK_D, BLOCK_Q * GROUP_P2, BLOCK_KV, WINDOW, UPCAST_DOT, PDL, EARLY,
                            PREFETCH)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + token[:, None] * stride_out + head[:, None] * HD + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HD)[None, :])


@triton.jit
def paged_attention_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, starts_ptr, q_lens_ptr, ctx_lens_ptr,
                                 part_out_ptr, part_lse_ptr, stride_q, stride_tables,
                                 SCALE: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                                 HD: tl.constexpr, GROUP: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                                 BLOCK_D: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
                                 BLOCK_KV: tl.constexpr, SPLITS: tl.constexpr, WINDOW: tl.constexpr,
                                 UPCAST_DOT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                                 PREFETCH: tl.constexpr):
    """paged_attention_kernel over one of SPLITS slices of the visible keys (flash decoding): writes each row's
    normalised partial output and its log-sum-exp; attention_merge_kernel combines the slices. A slice past the
    keys (slices are whole tiles of BLOCK_KV: after 128 cached tokens, 13 of 16 see none) writes only a log-sum-exp
    of -inf, after the wait, which the merge skips: no queries read, no partial output stored."""
    if PDL:  # programmatic dependent launch: the next kernel may start at once; EARLY waits later (in _attend, or
        # before an empty slice's log-sum-exp)
        gdc_launch_dependents()
        if not EARLY:
            gdc_wait()
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    q_tile, split = tl.program_id(2) // SPLITS, tl.program_id(2) % SPLITS
    token, head, row_ok, q_pos, kv_begin, kv_end, fresh = _query_rows(
        starts_ptr, q_lens_ptr, ctx_lens_ptr, seq, kv_head, q_tile, GROUP, GROUP_P2, BLOCK_Q, WINDOW)
    span = tl.cdiv(tl.cdiv(kv_end - kv_begin, SPLITS), BLOCK_KV) * BLOCK_KV
    lo = kv_begin + split * span
    slot = (token * HEADS + head) * SPLITS + split
    if lo < kv_end:
        acc, m_i, l_i = _attend(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, stride_q, stride_tables, seq, kv_head,
                                token, head, row_ok, q_pos, lo, tl.minimum(kv_end, lo + span), fresh, SCALE,
                                KV_HEADS, HD, CACHE_BLOCK, BLOCK_D, BLOCK_Q * GROUP_P2, BLOCK_KV, WINDOW, UPCAST_DOT,
                                PDL, EARLY, PREFETCH)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(part_out_ptr + slot[:, None] * HD + offs_d[None, :], out,
                 mask=row_ok[:, None] & (offs_d < HD)[None, :])
        tl.store(part_lse_ptr + slot, lse, mask=row_ok)
    else:
        if PDL and EARLY:  # the merge of the layer before may still read part_lse until then
            gdc_wait()
        tl.store(part_lse_ptr + slot, tl.full(slot.shape, float("-inf"), tl.float32), mask=row_ok)


@triton.jit
def attention_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_out, HEADS: tl.constexpr,
                           HD: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, head): the softmax-weighted sum of its SPLITS partial outputs."""
    if PDL:  # programmatic dependent launch: the next kernel may start; this one waits for the last's writes
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    base = (token * HEADS + head) * SPLITS
    lse = tl.load(part_lse_ptr + base + splits)
    peak = tl.max(lse, axis=0)
    weights = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - peak))
    parts = tl.load(part_out_ptr + (base + splits)[:, None] * HD + offs_d[None, :],
                    mask=(lse != float("-inf"))[:, None] & (offs_d < HD)[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + token * stride_out + head * HD + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HD)
