"""The ops of linear-attention layers (Gated DeltaNet), which keep a fixed-size state per sequence instead
of a growing KV cache. `causal_conv1d`: a depthwise causal convolution over a sequence's tokens that continues from
its last kernel - 1 inputs (the conv state). `gated_delta_rule`: a state S [value heads, key dim, value dim] that
each token decays by exp(g), corrects toward v along k by beta (S += k (beta (v - S^T k))^T) and reads with q.

A step packs sequences back to back as attention's do (seq_starts, query_lens, context_lens); `slots` names each
sequence's row of the state pool, and a sequence whose context is all in this step (context_len == query_len) starts
from zeros whatever its row holds, so a freed row needs no clearing. Both write the final state back in place. The
references are the recurrent forms; `chunked_gated_delta_rule` is the chunked form that prefill kernels compute
(tests prove the two equal), after Hugging Face's chunked gated delta rule."""

import numpy as np

from pegainfer.ir.registry import RECURRENCE, expect, register_op
from pegainfer.ir.types import TensorType

L2_EPS = 1e-6  # the q/k L2 norm's epsilon (FLA's and Hugging Face's)


def _expect_steps(op: str, slots: TensorType, seq_starts: TensorType, query_lens: TensorType,
                  context_lens: TensorType) -> None:
    batch = slots.shape[0] if slots.rank == 1 else None
    for name, t in (("slots", slots), ("seq_starts", seq_starts), ("query_lens", query_lens),
                    ("context_lens", context_lens)):
        expect(t.rank == 1 and t.shape == (batch,) and not t.dtype.is_float,
               f"{op}: {name} must be integer [batch] like slots {slots}, found {t}")


def _infer_conv(x: TensorType, weight: TensorType, conv_state: TensorType, slots: TensorType, seq_starts: TensorType,
                query_lens: TensorType, context_lens: TensorType, *,
                activation: str | None = None) -> tuple[TensorType, TensorType]:
    expect(x.rank == 2, f"causal_conv1d: x must be [tokens, channels], found {x}")
    expect(weight.rank == 2 and weight.shape[0] == x.shape[1] and isinstance(weight.shape[1], int)
           and weight.shape[1] >= 2, f"causal_conv1d: weight must be [{x.shape[1]}, kernel >= 2], found {weight}")
    expect(conv_state.rank == 3 and conv_state.shape[1:] == (x.shape[1], weight.shape[1] - 1),
           f"causal_conv1d: conv_state must be [slots, {x.shape[1]}, {weight.shape[1] - 1}], found {conv_state}")
    expect(activation in (None, "silu"), f"causal_conv1d: activation must be None or 'silu', found {activation!r}")
    _expect_steps("causal_conv1d", slots, seq_starts, query_lens, context_lens)
    return conv_state, x


def _conv(x: np.ndarray, weight: np.ndarray, conv_state: np.ndarray, slots: np.ndarray, seq_starts: np.ndarray,
          query_lens: np.ndarray, context_lens: np.ndarray, *,
          activation: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros_like(x, dtype=np.float32)
    width = weight.shape[1]
    for b, slot in enumerate(slots):
        start, q_len, ctx = int(seq_starts[b]), int(query_lens[b]), int(context_lens[b])
        if q_len == 0:
            continue
        past = np.zeros((width - 1, x.shape[1]), np.float32) if ctx == q_len \
            else conv_state[slot].T.astype(np.float32)
        inputs = np.concatenate([past, x[start:start + q_len].astype(np.float32)])  # [width - 1 + q_len, channels]
        windows = np.lib.stride_tricks.sliding_window_view(inputs, width, axis=0)  # [q_len, channels, width]
        y = np.einsum("tcw,cw->tc", windows, weight.astype(np.float32))
        out[start:start + q_len] = y / (1 + np.exp(-y)) if activation == "silu" else y
        conv_state[slot] = inputs[-(width - 1):].T.astype(conv_state.dtype)
    return conv_state, out


def _infer_delta(q: TensorType, k: TensorType, v: TensorType, g: TensorType, beta: TensorType, state: TensorType,
                 slots: TensorType, seq_starts: TensorType, query_lens: TensorType, context_lens: TensorType, *,
                 scale: float, l2norm: bool = True) -> tuple[TensorType, TensorType]:
    expect(q.rank == 3 and q == k, f"gated_delta_rule: q and k must be equal [tokens, key_heads, key_dim], "
                                   f"found {q} and {k}")
    expect(v.rank == 3 and v.shape[0] == q.shape[0], f"gated_delta_rule: v must be [{q.shape[0]}, value_heads, "
                                                     f"value_dim], found {v}")
    key_heads, value_heads = q.shape[1], v.shape[1]
    expect(isinstance(key_heads, int) and isinstance(value_heads, int) and value_heads % key_heads == 0,
           f"gated_delta_rule: value heads {value_heads} must be a multiple of key heads {key_heads}")
    for name, t in (("g", g), ("beta", beta)):
        expect(t.shape == v.shape[:2], f"gated_delta_rule: {name} must be [{v.shape[0]}, {value_heads}], found {t}")
    expect(state.rank == 4 and state.shape[1:] == (value_heads, q.shape[2], v.shape[2]) and state.dtype.is_float,
           f"gated_delta_rule: state must be float [slots, {value_heads}, {q.shape[2]}, {v.shape[2]}], found {state}")
    expect(scale > 0, f"gated_delta_rule: scale must be positive, found {scale}")
    _expect_steps("gated_delta_rule", slots, seq_starts, query_lens, context_lens)
    return state, v


def _prepared(q: np.ndarray, k: np.ndarray, value_heads: int, scale: float, l2norm: bool):
    """q and k in float32, L2-normed if asked, each key head repeated for its value heads, q times `scale`."""
    q, k = (np.repeat(np.asarray(a, np.float32), value_heads // a.shape[1], axis=1) for a in (q, k))
    if l2norm:
        q, k = (a / np.sqrt((a * a).sum(-1, keepdims=True) + np.float32(L2_EPS)) for a in (q, k))
    return q * np.float32(scale), k


def _delta(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray,
           slots: np.ndarray, seq_starts: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray, *,
           scale: float, l2norm: bool = True) -> tuple[np.ndarray, np.ndarray]:
    q, k = _prepared(q, k, v.shape[1], scale, l2norm)
    out = np.zeros(v.shape, np.float32)
    for b, slot in enumerate(slots):
        start, q_len, ctx = int(seq_starts[b]), int(query_lens[b]), int(context_lens[b])
        if q_len == 0:
            continue
        s = np.zeros(state.shape[1:], np.float32) if ctx == q_len else state[slot].astype(np.float32)
        for t in range(start, start + q_len):
            s = s * np.exp(g[t].astype(np.float32))[:, None, None]
            delta = (v[t] - np.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", s, q[t])
        state[slot] = s.astype(state.dtype)
    return state, out


def chunked_gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                             initial: np.ndarray | None, *, scale: float, l2norm: bool = True,
                             chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """One sequence ([tokens, heads, dim]) in chunks of `chunk` tokens: within a chunk the delta rule's updates are
    one unit lower triangular system (the UT transform), solved by forward substitution; across chunks the state
    carries. (out [tokens, value_heads, value_dim], final state)."""
    q, k = _prepared(q, k, v.shape[1], scale, l2norm)
    tokens, heads, value_dim = v.shape
    s = np.zeros((heads, q.shape[2], value_dim), np.float32) if initial is None else initial.astype(np.float32)
    out = np.zeros((tokens, heads, value_dim), np.float32)
    for begin in range(0, tokens, chunk):
        qc, kc, vc = (a[begin:begin + chunk].transpose(1, 0, 2) for a in (q, k, np.asarray(v, np.float32)))
        gc, bc = (np.asarray(a, np.float32)[begin:begin + chunk].T for a in (g, beta))  # [heads, n]
        n = qc.shape[1]
        decay = np.cumsum(gc, axis=1)  # log of the decay from the chunk's start through each token
        lower = np.tril(np.ones((n, n), bool))
        pairwise = np.where(lower, np.exp(np.where(lower, decay[:, :, None] - decay[:, None, :], 0)), 0)
        k_beta = kc * bc[:, :, None]
        system = np.einsum("hik,hjk->hij", k_beta, kc) * pairwise * ~np.eye(n, dtype=bool)
        # (I + A) X = B with A strictly lower: rows by forward substitution
        rhs = np.concatenate([vc * bc[:, :, None], k_beta * np.exp(decay)[:, :, None]], axis=2)
        solved = np.zeros_like(rhs)
        for i in range(n):
            solved[:, i] = rhs[:, i] - np.einsum("hj,hjd->hd", system[:, i, :i], solved[:, :i])
        new_values, k_decayed = solved[:, :, :value_dim], solved[:, :, value_dim:]
        v_new = new_values - np.einsum("hik,hkv->hiv", k_decayed, s)
        inner = np.einsum("hik,hjk->hij", qc, kc) * pairwise
        out[begin:begin + n] = (np.einsum("hik,hkv->hiv", qc * np.exp(decay)[:, :, None], s)
                                + np.einsum("hij,hjv->hiv", inner, v_new)).transpose(1, 0, 2)
        tail = np.exp(decay[:, -1:] - decay)[:, :, None]  # each token's decay to the chunk's end
        s = s * np.exp(decay[:, -1])[:, None, None] + np.einsum("hik,hiv->hkv", kc * tail, v_new)
    return out, s


register_op("causal_conv1d", _infer_conv, _conv, RECURRENCE, mutates=(2,))
register_op("gated_delta_rule", _infer_delta, _delta, RECURRENCE, mutates=(5,))
