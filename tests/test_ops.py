"""Op references checked against torch on random inputs: attention over a shuffled paged cache (prefill, decode
and chunked prefill in one step), the KV write with padding slots, RoPE and RMSNorm; row scaling's shape rule."""

import numpy as np
import pytest
import torch

from pegainfer.errors import GraphError
from pegainfer.ir.dtypes import FP32
from pegainfer.ir.registry import get_op, infer_types
from pegainfer.ir.types import TensorType

RNG = np.random.default_rng(0)


def reference(op: str, *args, **attrs):
    return get_op(op).reference(*args, **attrs)


def dense_causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """torch SDPA for one sequence whose q rows are the last rows of its k/v context."""
    group = q.shape[1] // k.shape[1]
    qt = torch.from_numpy(q).transpose(0, 1)
    kt = torch.from_numpy(np.repeat(k, group, axis=1)).transpose(0, 1)
    vt = torch.from_numpy(np.repeat(v, group, axis=1)).transpose(0, 1)
    q_len, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).numpy()


def test_paged_attention_matches_dense_attention_for_mixed_step():
    heads, kv_heads, head_dim, block_size, num_blocks = 6, 2, 16, 4, 40
    # (tokens already cached, tokens this step): a prefill, a decode token, a chunk of a longer prompt, a 1-token
    # prompt
    plan = [(0, 9), (12, 1), (5, 7), (0, 1)]
    k_cache = np.zeros((num_blocks, block_size, kv_heads, head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    free = list(RNG.permutation(num_blocks))
    tables, full_k, full_v, q_rows, slots = [], [], [], [], []
    for cached, new in plan:
        ctx = cached + new
        blocks = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(blocks)
        k = RNG.standard_normal((ctx, kv_heads, head_dim)).astype(np.float32)
        v = RNG.standard_normal((ctx, kv_heads, head_dim)).astype(np.float32)
        for pos in range(cached):  # earlier steps' KV is already in the cache
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
        full_k.append(k), full_v.append(v)
        q_rows.append(RNG.standard_normal((new, heads, head_dim)).astype(np.float32))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, ctx)]
    new_k = np.concatenate([k[c:] for k, (c, _) in zip(full_k, plan)])
    new_v = np.concatenate([v[c:] for v, (c, _) in zip(full_v, plan)])
    reference("kv_write", k_cache, v_cache, new_k, new_v, np.array(slots, np.int32))
    block_tables = np.zeros((len(plan), max(map(len, tables))), np.int32)
    for i, blocks in enumerate(tables):
        block_tables[i, : len(blocks)] = blocks
    query_lens = np.array([n for _, n in plan], np.int32)
    starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int32)
    out = reference("paged_attention", np.concatenate(q_rows), k_cache, v_cache, block_tables, starts, query_lens,
                    np.array([c + n for c, n in plan], np.int32), scale=head_dim ** -0.5)
    expected = np.concatenate([dense_causal_attention(q, k, v, head_dim ** -0.5)
                               for q, k, v in zip(q_rows, full_k, full_v)])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_kv_write_skips_padding_slots_and_rounds_to_cache_dtype():
    import ml_dtypes
    cache = np.zeros((2, 4, 1, 2), dtype=ml_dtypes.bfloat16)
    other = np.zeros_like(cache)
    k = np.array([[[1.0009765625, 2.0]], [[3.0, 4.0]]], np.float32)
    reference("kv_write", cache, other, k, k, np.array([5, -1], np.int32))
    assert cache[1, 1, 0].astype(np.float32).tolist() == [1.0, 2.0]  # 1.0009765625 rounds to 1.0 in bf16
    assert np.count_nonzero(cache.astype(np.float32)) == 2, "the padding slot (-1) must not be written"


def test_rope_matches_transformers_rotary_embedding():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    tokens, heads, head_dim, theta = 7, 3, 32, 10000.0
    x = RNG.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    positions = np.array([0, 1, 2, 40, 41, 100, 5000], np.int32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.from_numpy(positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    xt = torch.from_numpy(x).transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
    expected, _ = apply_rotary_pos_emb(xt, xt, emb.cos()[None], emb.sin()[None])
    out = reference("rope", x, positions, theta=theta)
    np.testing.assert_allclose(out, expected[0].transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_torch():
    x = RNG.standard_normal((5, 3, 24)).astype(np.float32) * 3
    w = RNG.standard_normal(24).astype(np.float32)
    expected = torch.nn.functional.rms_norm(torch.from_numpy(x), (24,), torch.from_numpy(w), eps=1e-6)
    np.testing.assert_allclose(reference("rms_norm", x, w, eps=1e-6), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_linear_embedding_and_gather():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    w = RNG.standard_normal((3, 6)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    np.testing.assert_allclose(reference("linear", x, w, b), x @ w.T + b, rtol=1e-6)
    table = RNG.standard_normal((10, 6)).astype(np.float32)
    np.testing.assert_array_equal(reference("embedding", np.array([3, 3, 9]), table), table[[3, 3, 9]])
    np.testing.assert_array_equal(reference("gather_rows", x, np.array([3, 0])), x[[3, 0]])
    np.testing.assert_allclose(reference("silu", x), torch.nn.functional.silu(torch.from_numpy(x)).numpy(),
                               rtol=1e-6)


def test_scale_rows_multiplies_each_row_by_its_scalar_and_refuses_a_scale_of_another_shape():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    scale = RNG.standard_normal((4, 1)).astype(np.float32)
    np.testing.assert_array_equal(reference("scale_rows", x, scale), x * scale[:, :1].repeat(6, axis=1))
    with pytest.raises(GraphError, match=r"scale_rows: the scale must be f32\[tokens,1\]"):
        infer_types("scale_rows", [TensorType(FP32, ("tokens", 6)), TensorType(FP32, ("tokens", 6))], {})


def test_top_k_ranks_the_rows_that_want_it_and_gives_the_others_their_largest():
    x = np.array([[0.5, 3.0, 3.0, -1.0], [2.0, -4.0, 7.0, 1.0]], np.float32)
    values, ids = get_op("top_k").reference(x, np.array([2, 0], np.int32), k=3)
    np.testing.assert_array_equal(ids, [[1, 2, 0], [2, -1, -1]])  # ties to the lower id
    np.testing.assert_array_equal(values, [[3.0, 3.0, 0.5], [7.0, -np.inf, -np.inf]])
    np.testing.assert_array_equal(get_op("top_k").reference(x, k=3)[1], [[1, 2, 0], [2, 0, 3]])
    with pytest.raises(GraphError, match="`wanted` must be int32"):
        get_op("top_k").infer(TensorType(FP32, ("rows", 4)), TensorType(FP32, ("rows",)), k=3)
