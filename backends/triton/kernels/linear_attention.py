"""The linear-attention recurrences of ir/ops/linear_attention.py over a packed step (seq_starts, query_lens,
context_lens; a sequence whose context is all in this step starts from zeros). State pools are rows per slot:
the convolution's [slots, channels, width - 1] (its last inputs, oldest first), the delta rule's float32
[slots, value heads, key dim, value dim]. Each kernel writes its sequences' final states in place."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def causal_conv1d_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, starts_ptr, qlens_ptr, ctx_ptr, out_ptr, stride_x,
                         stride_out, CHANNELS: tl.constexpr, WIDTH: tl.constexpr, SILU: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """A program per (sequence, channel block, token block): each output reads its WIDTH inputs, those before the
    step from the state. The first token block (the only one that reads the state: BLOCK_T >= WIDTH - 1) then
    writes the sequence's last WIDTH - 1 inputs back, in order, each read before it is overwritten."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq, cblk, tblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_len = tl.load(qlens_ptr + seq)
    if tblk * BLOCK_T >= q_len:
        return
    start = tl.load(starts_ptr + seq)
    carried = tl.load(ctx_ptr + seq) != q_len
    chans = cblk * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = chans < CHANNELS
    t = tblk * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = (t < q_len)[:, None] & cmask[None, :]
    state_row = state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * (CHANNELS * (WIDTH - 1)) + chans * (WIDTH - 1)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        off = (t - (WIDTH - 1) + j)[:, None]
        xv = tl.load(x_ptr + (start + off) * stride_x + chans[None, :], mask=tmask & (off >= 0), other=0.0)
        sv = tl.load(state_row[None, :] + (WIDTH - 1) + off, mask=tmask & (off < 0) & carried, other=0.0)
        w = tl.load(w_ptr + chans * WIDTH + j, mask=cmask, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + (start + t)[:, None] * stride_out + chans[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask)
    if tblk == 0:
        for j in tl.static_range(WIDTH - 1):
            back = q_len - (WIDTH - 1) + j
            x_in = tl.load(x_ptr + (start + back) * stride_x + chans, mask=cmask & (back >= 0), other=0.0)
            s_in = tl.load(state_row + (WIDTH - 1) + back, mask=cmask & (back < 0) & carried, other=0.0)
            tl.store(state_row + j, (x_in.to(tl.float32) + s_in.to(tl.float32)).to(state_ptr.dtype.element_ty),
                     mask=cmask)


@triton.jit
def _key_rows(ptr, rows, dims, mask, L2NORM: tl.constexpr, L2_EPS: tl.constexpr):
    """Rows of q or k in float32, each L2-normed if asked."""
    x = tl.load(ptr + rows + dims, mask=mask, other=0.0).to(tl.float32)
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) + L2_EPS)
    return x


@triton.jit
def _state_tile(state_ptr, slot, head, ks, vs, carried, VALUE_HEADS: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr):
    """(pointers, mask, the tile's values or zeros) of a head's state columns vs."""
    ptrs = state_ptr + ((slot.to(tl.int64) * VALUE_HEADS + head) * K + ks[:, None]) * V + vs[None, :]
    mask = (ks < K)[:, None] & (vs < V)[None, :]
    return ptrs, mask, tl.load(ptrs, mask=mask & carried, other=0.0)


@triton.jit
def gated_delta_rule_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, starts_ptr,
                                      qlens_ptr, ctx_ptr, out_ptr, decode_seqs, stride_q, stride_k, stride_v,
                                      stride_g, stride_beta, stride_out, KEY_HEADS: tl.constexpr,
                                      VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                      BK: tl.constexpr, BV: tl.constexpr, SCALE: tl.constexpr,
                                      L2NORM: tl.constexpr, L2_EPS: tl.constexpr, PDL: tl.constexpr):
    """The step's first `decode_seqs` sequences (one token each, as the scheduler packs decodes first), a program
    per (sequence, value head, value block), token by token: the state tile stays in registers."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq, head, vblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if seq >= decode_seqs:
        return
    start, q_len = tl.load(starts_ptr + seq), tl.load(qlens_ptr + seq)
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    ks, vs = tl.arange(0, BK), vblk * BV + tl.arange(0, BV)
    kmask, vmask = ks < K, vs < V
    ptrs, mask, s = _state_tile(state_ptr, tl.load(slots_ptr + seq), head, ks, vs,
                                tl.load(ctx_ptr + seq) != q_len, VALUE_HEADS, K, V)
    for i in range(q_len):
        tok = start + i
        q = _key_rows(q_ptr + key_head * K, tok * stride_q, ks, kmask, L2NORM, L2_EPS) * SCALE
        k = _key_rows(k_ptr + key_head * K, tok * stride_k, ks, kmask, L2NORM, L2_EPS)
        v = tl.load(v_ptr + tok * stride_v + head * V + vs, mask=vmask, other=0.0).to(tl.float32)
        s = s * tl.exp(tl.load(g_ptr + tok * stride_g + head).to(tl.float32))
        delta = (v - tl.sum(s * k[:, None], axis=0)) * tl.load(beta_ptr + tok * stride_beta + head).to(tl.float32)
        s = s + k[:, None] * delta[None, :]
        out = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + tok * stride_out + head * V + vs, out.to(out_ptr.dtype.element_ty), mask=vmask)
    tl.store(ptrs, s, mask=mask)


@triton.jit
def _inverse_unit_lower(a, rows, CHUNK: tl.constexpr):
    """(I + a)^-1 of a strictly lower triangular `a` [CHUNK, CHUNK], row by row (forward substitution): row i is
    e_i minus a's row i times the rows before it."""
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    inverse = eye
    for i in range(1, CHUNK):
        a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)
        row = tl.sum(tl.where(rows[:, None] == i, eye, 0.0), axis=0) - tl.sum(a_row[:, None] * inverse, axis=0)
        inverse = tl.where(rows[:, None] == i, row[None, :], inverse)
    return inverse


@triton.jit
def gated_delta_rule_chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, starts_ptr,
                                    qlens_ptr, ctx_ptr, out_ptr, decode_seqs, batch, stride_q, stride_k, stride_v,
                                    stride_g, stride_beta, stride_out, KEY_HEADS: tl.constexpr,
                                    VALUE_HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                                    BV: tl.constexpr, CHUNK: tl.constexpr, SCALE: tl.constexpr,
                                    L2NORM: tl.constexpr, L2_EPS: tl.constexpr, PDL: tl.constexpr):
    """The sequences after the first `decode_seqs` (prompt chunks), CHUNK tokens at a time in the chunked form
    (ir/ops/linear_attention.py's chunked_gated_delta_rule): within a chunk the updates are one unit lower
    triangular system, solved once and applied with tensor-core products; across chunks the state tile carries."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq, head, vblk = decode_seqs + tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if seq >= batch:
        return
    start, q_len = tl.load(starts_ptr + seq), tl.load(qlens_ptr + seq)
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    rows, ks, vs = tl.arange(0, CHUNK), tl.arange(0, BK), vblk * BV + tl.arange(0, BV)
    ptrs, mask, s = _state_tile(state_ptr, tl.load(slots_ptr + seq), head, ks, vs,
                                tl.load(ctx_ptr + seq) != q_len, VALUE_HEADS, K, V)
    lower = rows[:, None] >= rows[None, :]
    for begin in range(0, q_len, CHUNK):
        valid = begin + rows < q_len
        tok = start + begin + rows
        kmask = valid[:, None] & (ks < K)[None, :]
        q = _key_rows(q_ptr + key_head * K, tok[:, None] * stride_q, ks[None, :], kmask, L2NORM, L2_EPS) * SCALE
        k = _key_rows(k_ptr + key_head * K, tok[:, None] * stride_k, ks[None, :], kmask, L2NORM, L2_EPS)
        v = tl.load(v_ptr + tok[:, None] * stride_v + head * V + vs[None, :], mask=valid[:, None] & (vs < V)[None, :],
                    other=0.0).to(tl.float32)
        g = tl.cumsum(tl.load(g_ptr + tok * stride_g + head, mask=valid, other=0.0).to(tl.float32), axis=0)
        beta = tl.load(beta_ptr + tok * stride_beta + head, mask=valid, other=0.0).to(tl.float32)
        decay = tl.where(lower, tl.exp(tl.where(lower, g[:, None] - g[None, :], 0.0)), 0.0)
        system = tl.where(rows[:, None] > rows[None, :], tl.dot(k, tl.trans(k)) * decay * beta[:, None], 0.0)
        inverse = _inverse_unit_lower(system, rows, CHUNK)
        w = tl.dot(inverse, k * (beta * tl.exp(g))[:, None])
        v_new = tl.dot(inverse, v * beta[:, None]) - tl.dot(w, s)
        out = tl.dot(q * tl.exp(g)[:, None], s) + tl.dot(tl.dot(q, tl.trans(k)) * decay, v_new)
        tl.store(out_ptr + tok[:, None] * stride_out + head * V + vs[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (vs < V)[None, :])
        last = tl.sum(tl.where(rows == CHUNK - 1, g, 0.0), axis=0)  # masked tokens decay by 1: the last valid's
        s = s * tl.exp(last) + tl.dot(tl.trans(k * tl.exp(last - g)[:, None]), v_new)
    tl.store(ptrs, s, mask=mask)
