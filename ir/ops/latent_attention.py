"""Multi-head latent attention over a latent KV cache, in the packed layout of ir/ops/attention.py.

The cache holds one "head" a token: its normalised latent (L values) then its rotated rope key (R values),
[num_blocks, block_size, 1, L + R]. Keys and values of query head h are expanded from the latent by kv_b, whose
rows for head h are its N key rows then its V value rows ([H * (N + V), L]).

`mla_attention` is the declared form: each head's keys (its expanded key, then the shared rope key) and values
expanded from the cached latents. The absorbed form computes the same in the latent space: the query folded through
the key rows (`head_linear` transposed), `latent_attention` of all heads against the one latent head (values: the
latents), and the result taken through the value rows (`head_linear`).
"""

import numpy as np

from pegainfer.ir.ops.attention import _gather
from pegainfer.ir.registry import ATTENTION, CACHE_WRITE, GEMM, expect, register_op
from pegainfer.ir.types import TensorType


def _expect_latent_cache(op: str, cache: TensorType) -> None:
    expect(cache.rank == 4 and cache.shape[2] == 1 and isinstance(cache.shape[3], int),
           f"{op}: the latent cache must be [blocks, block_size, 1, latent + rope], found {cache}")
    expect(not cache.dtype.name.startswith("f8"), f"{op}: an FP8 latent cache is not implemented, found {cache}")


def _expect_packed(op: str, block_tables: TensorType, *per_sequence: TensorType) -> None:
    expect(block_tables.rank == 2, f"{op}: block_tables must be [batch, max_blocks], found {block_tables}")
    batch = block_tables.shape[0]
    for t in per_sequence:
        expect(t.shape == (batch,) and not t.dtype.is_float, f"{op}: seq_starts, query_lens and context_lens must "
                                                             f"be integer [{batch}], found {t}")


def _infer_latent_write(cache: TensorType, latent: TensorType, rope_key: TensorType,
                        slot_mapping: TensorType) -> TensorType:
    _expect_latent_cache("latent_write", cache)
    expect(latent.rank == 2 and rope_key.rank == 2 and latent.shape[0] == rope_key.shape[0]
           and latent.shape[1] + rope_key.shape[1] == cache.shape[3],
           f"latent_write: latent [tokens, L] and rope key [tokens, R] must fill the cache's {cache.shape[3]} values, "
           f"found {latent} and {rope_key}")
    expect(slot_mapping.shape == (latent.shape[0],) and not slot_mapping.dtype.is_float,
           f"latent_write: slot_mapping must be integer [{latent.shape[0]}], found {slot_mapping}")
    return cache


def _latent_write(cache: np.ndarray, latent: np.ndarray, rope_key: np.ndarray,
                  slot_mapping: np.ndarray) -> np.ndarray:
    flat = cache.reshape(-1, cache.shape[3])
    assert np.shares_memory(flat, cache), "latent_write needs a contiguous cache to write in place"
    real = slot_mapping >= 0
    flat[slot_mapping[real]] = np.concatenate([latent[real], rope_key[real]], axis=-1).astype(cache.dtype)
    return cache


def _infer_mla(q_nope: TensorType, q_rope: TensorType, cache: TensorType, kv_b: TensorType,
               block_tables: TensorType, seq_starts: TensorType, query_lens: TensorType, context_lens: TensorType,
               *, scale: float) -> TensorType:
    _expect_latent_cache("mla_attention", cache)
    expect(q_nope.rank == 3 and q_rope.rank == 3 and q_nope.shape[:2] == q_rope.shape[:2],
           f"mla_attention: q_nope and q_rope must be [tokens, heads, *] alike, found {q_nope} and {q_rope}")
    tokens, heads, nope = q_nope.shape
    latent = cache.shape[3] - q_rope.shape[2]
    expect(kv_b.rank == 2 and kv_b.shape[1] == latent and kv_b.shape[0] % heads == 0
           and kv_b.shape[0] // heads > nope,
           f"mla_attention: kv_b must be [{heads} * ({nope} + V), {latent}], found {kv_b}")
    _expect_packed("mla_attention", block_tables, seq_starts, query_lens, context_lens)
    expect(scale > 0, f"mla_attention: scale must be positive, found {scale}")
    return q_nope.with_shape((tokens, heads, kv_b.shape[0] // heads - nope))


def _mla(q_nope: np.ndarray, q_rope: np.ndarray, cache: np.ndarray, kv_b: np.ndarray, block_tables: np.ndarray,
         seq_starts: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray, *, scale: float) -> np.ndarray:
    """Causal attention of each head against the keys and values kv_b expands from the cached latents."""
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    latent_dim = kv_b.shape[1]
    per_head = kv_b.reshape(heads, -1, latent_dim)
    out = np.zeros((q_nope.shape[0], heads, per_head.shape[1] - nope), np.float32)
    for start, q_len, context in _sequences(block_tables, seq_starts, query_lens, context_lens, cache):
        latent, rope_key = context[:, :latent_dim], context[:, latent_dim:]
        expanded = np.einsum("kl,hdl->khd", latent, per_head)  # [ctx, heads, N + V]
        rows = slice(start, start + q_len)
        scores = (np.einsum("qhd,khd->hqk", q_nope[rows], expanded[..., :nope])
                  + np.einsum("qhr,kr->hqk", q_rope[rows], rope_key)) * np.float32(scale)
        out[rows] = np.einsum("hqk,khd->qhd", _causal_softmax(scores), expanded[..., nope:])
    return out


def _infer_latent_attention(q_latent: TensorType, q_rope: TensorType, cache: TensorType, block_tables: TensorType,
                            seq_starts: TensorType, query_lens: TensorType, context_lens: TensorType,
                            *, scale: float) -> TensorType:
    _expect_latent_cache("latent_attention", cache)
    expect(q_latent.rank == 3 and q_rope.rank == 3 and q_latent.shape[:2] == q_rope.shape[:2]
           and q_latent.shape[2] + q_rope.shape[2] == cache.shape[3],
           f"latent_attention: q_latent [tokens, heads, L] and q_rope [tokens, heads, R] must fill the cache's "
           f"{cache.shape[3]} values, found {q_latent} and {q_rope}")
    _expect_packed("latent_attention", block_tables, seq_starts, query_lens, context_lens)
    expect(scale > 0, f"latent_attention: scale must be positive, found {scale}")
    return q_latent


def _latent_attention(q_latent: np.ndarray, q_rope: np.ndarray, cache: np.ndarray, block_tables: np.ndarray,
                      seq_starts: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray,
                      *, scale: float) -> np.ndarray:
    """Causal attention of every head against the one latent head: keys the whole cached row, values its latent."""
    latent_dim = q_latent.shape[2]
    out = np.zeros_like(q_latent, dtype=np.float32)
    for start, q_len, context in _sequences(block_tables, seq_starts, query_lens, context_lens, cache):
        rows = slice(start, start + q_len)
        query = np.concatenate([q_latent[rows], q_rope[rows]], axis=-1)
        scores = np.einsum("qhd,kd->hqk", query, context) * np.float32(scale)
        out[rows] = np.einsum("hqk,kd->qhd", _causal_softmax(scores), context[:, :latent_dim])
    return out


def _sequences(block_tables: np.ndarray, seq_starts: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray,
               cache: np.ndarray):
    """(first row, query length, cached rows [ctx, L + R] in float32) of each sequence with queries in the step."""
    block_size = cache.shape[1]
    for b in range(block_tables.shape[0]):
        start, q_len, ctx = int(seq_starts[b]), int(query_lens[b]), int(context_lens[b])
        if q_len:
            yield start, q_len, _gather(cache, block_tables[b, : -(-ctx // block_size)], ctx)[:, 0]


def _causal_softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over keys of scores [heads, q_len, ctx] whose queries are the last q_len positions."""
    q_len, ctx = scores.shape[1:]
    visible = np.arange(ctx)[None, :] <= np.arange(ctx - q_len, ctx)[:, None]
    scores = np.where(visible, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return probs / probs.sum(axis=-1, keepdims=True)


def _infer_head_linear(x: TensorType, w: TensorType, *, transposed: bool = False) -> TensorType:
    expect(x.rank == 3 and isinstance(x.shape[1], int) and isinstance(x.shape[2], int) and x.dtype.is_float,
           f"head_linear: input must be float [tokens, heads, K], found {x}")
    heads, k = x.shape[1], x.shape[2]
    rows_per_head = w.shape[0] // heads if w.rank == 2 and w.shape[0] % heads == 0 else 0
    fits = w.rank == 2 and rows_per_head and (rows_per_head == k if transposed else w.shape[1] == k)
    expect(bool(fits), f"head_linear: weight must be [{heads} * {'K' if transposed else 'N'}, "
                       f"{'N' if transposed else k}] with K = {k}, found {w}")
    return x.with_shape((x.shape[0], heads, w.shape[1] if transposed else rows_per_head))


def _head_linear(x: np.ndarray, w: np.ndarray, *, transposed: bool = False) -> np.ndarray:
    """Per head h, x[:, h] times its block of w's rows: transposed (x @ w_h) or as a linear (x @ w_h.T)."""
    blocks = w.reshape(x.shape[1], -1, w.shape[1])
    return np.einsum("thk,hkn->thn" if transposed else "thk,hnk->thn", x, blocks)


register_op("latent_write", _infer_latent_write, _latent_write, CACHE_WRITE, mutates=(0,))
register_op("mla_attention", _infer_mla, _mla, ATTENTION)
register_op("latent_attention", _infer_latent_attention, _latent_attention, ATTENTION)
register_op("head_linear", _infer_head_linear, _head_linear, GEMM)
