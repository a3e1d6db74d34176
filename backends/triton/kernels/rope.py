"""Per-head q/k RMSNorm + RoPE + the paged KV write (layouts: ir/ops/attention.py): a program per (token, head) for
decode steps, a program per token for prompt chunks. RoPE frequencies follow ir/ops/attention.py's rope_inv_freq:
SCALING 0 none, 1 linear, 2 by_wavelength; a partial rotary (ROT < HD dims rotated, the rest passed through) runs
the program per (token, head) alone. An FP8 cache comes with k_scale_ptr and v_scale_ptr (None otherwise):
the write stores x / scale, saturated."""

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
def _norm_rotate_partial(x_ptr, w_ptr, pos, HD: tl.constexpr, ROT: tl.constexpr, BLOCK_HD: tl.constexpr,
                         EPS: tl.constexpr, NORM: tl.constexpr, NORM_OFFSET: tl.constexpr, THETA: tl.constexpr,
                         SCALING: tl.constexpr, FACTOR: tl.constexpr, LOW_FREQ: tl.constexpr,
                         HIGH_FREQ: tl.constexpr, ORIGINAL: tl.constexpr):
    """A head's RMSNorm over all HD dims, then the rotation of its first ROT: dim j < ROT pairs with its partner
    j +- ROT / 2, loaded beside it; the dims from ROT on pass through."""
    rot_half: tl.constexpr = ROT // 2
    offs = tl.arange(0, BLOCK_HD)
    mask = offs < HD
    partner = tl.where(offs < rot_half, offs + rot_half, tl.where(offs < ROT, offs - rot_half, offs))
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HD + EPS)
        x = x * rstd * (tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + NORM_OFFSET)
        xp = xp * rstd * (tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32) + NORM_OFFSET)
    cos, sin = _rotation(pos, offs % rot_half, ROT, THETA, SCALING, FACTOR, LOW_FREQ, HIGH_FREQ, ORIGINAL)
    rotated = x * cos + tl.where(offs < rot_half, -xp, xp) * sin
    return tl.where(offs < ROT, rotated, x), offs, mask


@triton.jit
def _rope_partial_head(q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                       k_scale_ptr, v_scale_ptr, token, head, pos, slot, stride_q, stride_k, stride_v, stride_q_out,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
                       BLOCK_HD: tl.constexpr, EPS: tl.constexpr, NORM: tl.constexpr, NORM_OFFSET: tl.constexpr,
                       THETA: tl.constexpr, SCALING: tl.constexpr, FACTOR: tl.constexpr, LOW_FREQ: tl.constexpr,
                       HIGH_FREQ: tl.constexpr, ORIGINAL: tl.constexpr):
    """One (token, head) of qk_rope_kv_write_kernel under a partial rotary."""
    if head < HEADS:
        out, offs, mask = _norm_rotate_partial(q_ptr + token * stride_q + head * HD, q_norm_ptr, pos, HD, ROT,
                                               BLOCK_HD, EPS, NORM, NORM_OFFSET, THETA, SCALING, FACTOR, LOW_FREQ,
                                               HIGH_FREQ, ORIGINAL)
        tl.store(q_out_ptr + token * stride_q_out + head * HD + offs, out.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kv_head = head - HEADS
        out, offs, mask = _norm_rotate_partial(k_ptr + token * stride_k + kv_head * HD, k_norm_ptr, pos, HD, ROT,
                                               BLOCK_HD, EPS, NORM, NORM_OFFSET, THETA, SCALING, FACTOR, LOW_FREQ,
                                               HIGH_FREQ, ORIGINAL)
        write = mask & (slot >= 0)
        cache_offset = (slot.to(tl.int64) * KV_HEADS + kv_head) * HD
        tl.store(k_cache_ptr + cache_offset + offs, _to_cache(out, k_scale_ptr, k_cache_ptr), mask=write)
        v = tl.load(v_ptr + token * stride_v + kv_head * HD + offs, mask=mask, other=0.0)
        tl.store(v_cache_ptr + cache_offset + offs, _to_cache(v, v_scale_ptr, v_cache_ptr), mask=write)


@triton.jit
def _to_cache(x, scale_ptr, cache_ptr):
    """A key or value row as the cache stores it: for an FP8 cache, divided by the layer's scale and saturated."""
    if scale_ptr is not None:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def qk_rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, slot_ptr, q_out_ptr,
                            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_q, stride_k, stride_v,
                            stride_q_out,
                            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HD: tl.constexpr, EPS: tl.constexpr,
                            NORM: tl.constexpr, NORM_OFFSET: tl.constexpr, THETA: tl.constexpr,
                            SCALING: tl.constexpr, FACTOR: tl.constexpr, LOW_FREQ: tl.constexpr,
                            HIGH_FREQ: tl.constexpr, ORIGINAL: tl.constexpr, BLOCK_HALF: tl.constexpr,
                            ROT: tl.constexpr, BLOCK_HD: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """EARLY (positions and slots are step inputs, uploaded before the step): the position, the slot, the norm's
    weights and the rotation's cos and sin come before the wait for the previous kernel, whose output is only the
    heads."""
    if PDL:  # programmatic dependent launch: the next kernel may start at once
        gdc_launch_dependents()
        if not EARLY:
            gdc_wait()
    token = tl.program_id(0)
    head = tl.program_id(1)
    if ROT < HD:
        pos, slot = tl.load(pos_ptr + token).to(tl.float32), tl.load(slot_ptr + token)
        if PDL and EARLY:
            gdc_wait()
        _rope_partial_head(q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                           k_scale_ptr, v_scale_ptr, token, head, pos, slot, stride_q, stride_k, stride_v,
                           stride_q_out, HEADS, KV_HEADS, HD, ROT, BLOCK_HD, EPS, NORM, NORM_OFFSET, THETA, SCALING,
                           FACTOR, LOW_FREQ, HIGH_FREQ, ORIGINAL)
        return
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
        k_dst, v_dst = k_cache_ptr + cache_offset, v_cache_ptr + cache_offset
        tl.store(k_dst + offs, _to_cache(o1, k_scale_ptr, k_cache_ptr), mask=write)
        tl.store(k_dst + half + offs, _to_cache(o2, k_scale_ptr, k_cache_ptr), mask=write)
        src = v_ptr + token * stride_v + kv_head * HD
        v1 = tl.load(src + offs, mask=mask, other=0.0)
        v2 = tl.load(src + half + offs, mask=mask, other=0.0)
        tl.store(v_dst + offs, _to_cache(v1, v_scale_ptr, v_cache_ptr), mask=write)
        tl.store(v_dst + half + offs, _to_cache(v2, v_scale_ptr, v_cache_ptr), mask=write)


@triton.jit
def qk_rope_kv_write_rows_kernel(q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, pos_ptr, slot_ptr, q_out_ptr,
                                 k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_q, stride_k, stride_v,
                                 stride_q_out,
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
    tl.store(k_cache_ptr + cache, _to_cache(o1, k_scale_ptr, k_cache_ptr), mask=write)
    tl.store(k_cache_ptr + cache + half, _to_cache(o2, k_scale_ptr, k_cache_ptr), mask=write)
    v_src = v_ptr + token * stride_v + kv_head * HD + offs[None, :]
    v1 = tl.load(v_src, mask=is_k & col_ok, other=0.0)
    v2 = tl.load(v_src + half, mask=is_k & col_ok, other=0.0)
    tl.store(v_cache_ptr + cache, _to_cache(v1, v_scale_ptr, v_cache_ptr), mask=write)
    tl.store(v_cache_ptr + cache + half, _to_cache(v2, v_scale_ptr, v_cache_ptr), mask=write)
