"""Grouped-query causal attention over the paged cache (layouts: ir/ops/attention.py): a program per (sequence, kv
head, query tile), which keeps an online softmax over key tiles gathered through the block table. A sliding WINDOW
(0: none) masks keys more than WINDOW - 1 positions behind a query, and skips the tiles no query of a program sees.
An FP8 cache comes with k_scale_ptr and v_scale_ptr (None otherwise): the scores take k's scale, the output v's,
and the stored values become the queries' dtype exactly."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# include: fp8.py
# include: dot.py


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
def _softmax_tile(q, q_pos, k, v, pos, pos_ok, acc, m_i, l_i, qk_scale, ROWS: tl.constexpr,
                  BLOCK_KV: tl.constexpr, WINDOW: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One tile of keys and values into the online softmax's (unnormalised out, max, sum); FP8 keys and values
    become q's dtype exactly (widen_e4m3), their scales in `qk_scale` and applied to the output by _attend."""
    k, v = widen_e4m3(k, q.dtype, UPCAST_DOT), widen_e4m3(v, q.dtype, UPCAST_DOT)
    scores = _dot(q, tl.trans(k), tl.zeros([ROWS, BLOCK_KV], tl.float32), UPCAST_DOT) * qk_scale
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
def _attend(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, stride_q, stride_tables, seq,
            kv_head, token, head, row_ok, q_pos, lo, hi, fresh, SCALE: tl.constexpr, KV_HEADS: tl.constexpr,
            HD: tl.constexpr, CACHE_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
            BLOCK_KV: tl.constexpr, WINDOW: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr,
            EARLY: tl.constexpr, PREFETCH: tl.constexpr):
    """Online softmax over the keys lo .. hi, gathered through the block table: (unnormalised out, max, sum).
    PREFETCH (EARLY: the step inputs come from the upload, not from a kernel): the first tile's keys and values
    before `fresh` (written by earlier steps) are read before the wait for the previous kernel, this step's
    after it with the queries. They stay in registers across the wait (71 more a thread: 3 programs an SM where
    5 fit), which pays only while the step's programs fit one wave; an L2 prefetch instead gained nothing."""
    tl.static_assert(EARLY or not PREFETCH, "PREFETCH reads keys before the wait: only with EARLY step inputs")
    qk_scale = SCALE
    lift = 1.0
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q_ptr.dtype.element_ty == tl.bfloat16:
        lift = BF16_LIFT
    if k_scale_ptr is not None:
        qk_scale = SCALE * tl.load(k_scale_ptr) * lift
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
        acc, m_i, l_i = _softmax_tile(q, q_pos, k, v, pos, pos_ok, acc, m_i, l_i, qk_scale, ROWS, BLOCK_KV,
                                      WINDOW, UPCAST_DOT)
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
        acc, m_i, l_i = _softmax_tile(q, q_pos, k, v, pos, pos_ok, acc, m_i, l_i, qk_scale, ROWS, BLOCK_KV,
                                      WINDOW, UPCAST_DOT)
    if v_scale_ptr is not None:
        acc = acc * (tl.load(v_scale_ptr) * lift)
    return acc, m_i, l_i


@triton.jit
def paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, starts_ptr,
                           q_lens_ptr, ctx_lens_ptr, out_ptr, stride_q, stride_out, stride_tables,
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
    acc, m_i, l_i = _attend(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, stride_q,
                            stride_tables, seq, kv_head, token, head, row_ok, q_pos, kv_begin, kv_end, fresh, SCALE,
                            KV_HEADS, HD, CACHE_BLOCK, BLOCK_D, BLOCK_Q * GROUP_P2, BLOCK_KV, WINDOW, UPCAST_DOT,
                            PDL, EARLY, PREFETCH)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + token[:, None] * stride_out + head[:, None] * HD + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HD)[None, :])


@triton.jit
def paged_attention_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, starts_ptr,
                                 q_lens_ptr, ctx_lens_ptr, part_out_ptr, part_lse_ptr, stride_q, stride_tables,
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
        acc, m_i, l_i = _attend(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, stride_q,
                                stride_tables, seq, kv_head, token, head, row_ok, q_pos, lo,
                                tl.minimum(kv_end, lo + span), fresh, SCALE, KV_HEADS, HD, CACHE_BLOCK, BLOCK_D,
                                BLOCK_Q * GROUP_P2, BLOCK_KV, WINDOW, UPCAST_DOT, PDL, EARLY, PREFETCH)
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
