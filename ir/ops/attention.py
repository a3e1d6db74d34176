"""Rotary embedding, the paged KV-cache write and grouped-query causal attention over the paged cache.

Packed layout (shared by prefill, decode and a mix of both): the step's tokens of all sequences are concatenated
along `tokens`. Sequence b owns rows seq_starts[b] .. seq_starts[b] + query_lens[b]; after this step's write its
cache holds context_lens[b] tokens, and its query rows are the last query_lens[b] of them, so query row i sits at
position context_lens[b] - query_lens[b] + i and sees keys 0 .. that position (causal).
The cache is [num_blocks, block_size, kv_heads, head_dim] per layer; token slot s lives in block s // block_size at
offset s % block_size; block_tables[b] lists the blocks of sequence b in order. A slot of -1 is padding: not written.
An FP8 cache takes a float32 scale [1] each for keys and values (kv_write's and paged_attention's last two inputs):
it stores e4m3(x / scale), saturated at the largest finite value, and attention reads the stored value x scale.
"""

import numpy as np

from pegainfer.ir.dtypes import FP32
from pegainfer.ir.registry import ATTENTION, CACHE_WRITE, ELEMENTWISE, expect, register_op
from pegainfer.ir.types import TensorType


def _infer_rope(x: TensorType, positions: TensorType, *, theta: float, scaling: tuple | None = None,
                rotary_dim: int = 0, interleaved: bool = False) -> TensorType:
    expect(x.rank == 3, f"rope: input must be [tokens, heads, head_dim], found {x}")
    expect(isinstance(x.shape[2], int) and x.shape[2] % 2 == 0, f"rope: head_dim must be even, found {x}")
    expect(rotary_dim == 0 or (rotary_dim % 2 == 0 and 0 < rotary_dim <= x.shape[2]),
           f"rope: rotary_dim must be 0 (all of head_dim) or even and at most {x.shape[2]}, found {rotary_dim}")
    expect(positions.rank == 1 and positions.shape[0] == x.shape[0] and not positions.dtype.is_float,
           f"rope: positions must be integer [{x.shape[0]}], found {positions}")
    expect(theta > 0, f"rope: theta must be positive, found {theta}")
    expect(scaling is None or (scaling[0] == "linear" and len(scaling) == 2 and scaling[1] > 0)
           or (scaling[0] == "by_wavelength" and len(scaling) == 5 and scaling[1] > 0 and scaling[3] > scaling[2] > 0
               and scaling[4] > 0)
           or (scaling[0] == "yarn" and len(scaling) == 5 and scaling[1] > 0 and 0 <= scaling[2] <= scaling[3]
               and scaling[4] > 0),
           f"rope: scaling must be null, (linear, factor), (by_wavelength, factor, low_freq_factor, "
           f"high_freq_factor, original_max_position) or (yarn, factor, low_dim, high_dim, attention_factor), "
           f"found {scaling}")
    expect(isinstance(interleaved, bool) and not (interleaved and rotary_dim),
           f"rope: interleaved must be a bool, and not with a partial rotary, found {interleaved!r}")
    return x


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """The rotation frequencies [head_dim / 2] in float32, as Hugging Face computes them: unscaled, linear (every
    frequency divided by the factor), by_wavelength (Hugging Face's rope_type of Meta's 3.1 models: frequencies
    whose wavelength exceeds original_max_position / low_freq_factor divided by the factor, those under
    original_max_position / high_freq_factor kept, a smooth blend between) and yarn (frequency i divided by the
    factor by a ramp from 0 at dim low_dim to 1 at high_dim)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    if scaling is None:
        return inv_freq
    kind, factor = scaling[0], np.float32(scaling[1])
    if kind == "linear":
        return inv_freq / factor
    if kind == "yarn":
        low, high = np.float32(scaling[2]), np.float32(scaling[3] if scaling[3] > scaling[2] else scaling[2] + 0.001)
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        return (inv_freq / factor * ramp + inv_freq * (np.float32(1) - ramp)).astype(np.float32)
    low, high, original = (np.float32(v) for v in scaling[2:])
    wavelen = np.float32(2 * np.pi) / inv_freq
    low_wavelen, high_wavelen = original / low, original / high
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (np.float32(1.0) - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float,
                 scaling: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables [tokens, head_dim] in float32, halves repeated (the rotate-half convention); yarn's
    attention factor scales both."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = positions.astype(np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    angles = np.concatenate([freqs, freqs], axis=-1)
    factor = np.float32(scaling[4]) if scaling is not None and scaling[0] == "yarn" else np.float32(1)
    return np.cos(angles) * factor, np.sin(angles) * factor


def _rope(x: np.ndarray, positions: np.ndarray, *, theta: float, scaling: tuple | None = None,
          rotary_dim: int = 0, interleaved: bool = False) -> np.ndarray:
    """Rotates the first `rotary_dim` dims of each head (all when 0: partial rotary leaves the rest as they are);
    interleaved: dims 2i and 2i + 1 form pair i instead of i and i + head_dim / 2."""
    dims = rotary_dim or x.shape[-1]
    if interleaved:
        order = np.concatenate([np.arange(0, dims, 2), np.arange(1, dims, 2)])
        out = np.empty_like(x)
        out[..., order] = _rope(x[..., order], positions, theta=theta, scaling=scaling)
        return out
    cos, sin = rope_cos_sin(positions, dims, theta, scaling)
    rot, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return np.concatenate([rot * cos[:, None, :] + rotated * sin[:, None, :], rest], axis=-1)


FP8_CACHE_MAX = 448.0  # the largest finite float8 e4m3fn: a stored value saturates there


def _expect_cache_scales(op: str, cache: TensorType, scales: tuple[TensorType, ...]) -> None:
    """An FP8 cache comes with its two scales; any other cache with none."""
    fp8 = cache.dtype.name.startswith("f8")
    wanted = "two scales (k, v)" if fp8 else "no scales"
    expect(len(scales) == (2 if fp8 else 0), f"{op}: a {cache.dtype} cache takes {wanted}, found {len(scales)}")
    for t in scales:
        expect(t == TensorType(FP32, (1,)), f"{op}: a cache scale must be f32[1], found {t}")


def _infer_kv_write(k_cache: TensorType, v_cache: TensorType, k: TensorType, v: TensorType,
                    slot_mapping: TensorType, *scales: TensorType) -> tuple[TensorType, TensorType]:
    expect(k_cache.rank == 4 and k_cache == v_cache,
           f"kv_write: caches must be equal [blocks, block_size, kv_heads, head_dim], found {k_cache} and {v_cache}")
    expect(k.rank == 3 and k.shape == v.shape, f"kv_write: k and v must be equal [tokens, kv_heads, head_dim], "
                                               f"found {k} and {v}")
    expect(k.shape[1:] == k_cache.shape[2:], f"kv_write: k {k} does not fit cache {k_cache}")
    expect(slot_mapping.shape == (k.shape[0],) and not slot_mapping.dtype.is_float,
           f"kv_write: slot_mapping must be integer [{k.shape[0]}], found {slot_mapping}")
    _expect_cache_scales("kv_write", k_cache, scales)
    return k_cache, v_cache


def _kv_write(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
              slot_mapping: np.ndarray, *scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    real = slot_mapping >= 0
    for cache, new, scale in zip((k_cache, v_cache), (k, v), scales or (None, None)):
        flat = cache.reshape(-1, *cache.shape[2:])
        assert np.shares_memory(flat, cache), "kv_write needs a contiguous cache to write in place"
        rows = new[real].astype(np.float32)
        if scale is not None:
            rows = np.clip(rows / np.float32(scale[0]), -FP8_CACHE_MAX, FP8_CACHE_MAX)
        flat[slot_mapping[real]] = rows.astype(cache.dtype)
    return k_cache, v_cache


def _infer_attention(q: TensorType, k_cache: TensorType, v_cache: TensorType, block_tables: TensorType,
                     seq_starts: TensorType, query_lens: TensorType, context_lens: TensorType,
                     *scales: TensorType, scale: float, window: int = 0) -> TensorType:
    expect(q.rank == 3, f"paged_attention: q must be [tokens, heads, head_dim], found {q}")
    expect(k_cache.rank == 4 and k_cache == v_cache, f"paged_attention: caches must be equal rank-4, "
                                                     f"found {k_cache} and {v_cache}")
    expect(q.shape[2] == k_cache.shape[3], f"paged_attention: head_dim of q {q} and cache {k_cache} differ")
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    expect(isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads == 0,
           f"paged_attention: query heads {heads} must be a multiple of kv heads {kv_heads}")
    expect(block_tables.rank == 2, f"paged_attention: block_tables must be [batch, max_blocks], found {block_tables}")
    batch = block_tables.shape[0]
    for name, t in (("seq_starts", seq_starts), ("query_lens", query_lens), ("context_lens", context_lens)):
        expect(t.shape == (batch,) and not t.dtype.is_float, f"paged_attention: {name} must be integer [{batch}], "
                                                             f"found {t}")
    expect(scale > 0, f"paged_attention: scale must be positive, found {scale}")
    expect(isinstance(window, int) and window >= 0, f"paged_attention: window must be an int >= 0 (0: none), "
                                                     f"found {window!r}")
    _expect_cache_scales("paged_attention", k_cache, scales)
    return q


def _attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
               seq_starts: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray,
               *scales: np.ndarray, scale: float, window: int = 0) -> np.ndarray:
    """Causal; with a window, query position p sees keys p - window + 1 .. p (Hugging Face's sliding window)."""
    out = np.zeros_like(q)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    for b in range(block_tables.shape[0]):
        start, q_len, ctx = int(seq_starts[b]), int(query_lens[b]), int(context_lens[b])
        if q_len == 0:
            continue
        blocks = block_tables[b, : -(-ctx // block_size)]
        k_scale, v_scale = (np.float32(s[0]) for s in scales) if scales else (np.float32(1), np.float32(1))
        keys = np.repeat(_gather(k_cache, blocks, ctx) * k_scale, group, axis=1)  # [ctx, heads, head_dim]
        values = np.repeat(_gather(v_cache, blocks, ctx) * v_scale, group, axis=1)
        queries = q[start:start + q_len]
        scores = np.einsum("qhd,khd->hqk", queries, keys) * np.float32(scale)
        query_pos = np.arange(ctx - q_len, ctx)[:, None]
        key_pos = np.arange(ctx)[None, :]
        visible = (key_pos <= query_pos) & ((key_pos > query_pos - window) if window else True)
        scores = np.where(visible, scores, -np.inf)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[start:start + q_len] = np.einsum("hqk,khd->qhd", probs, values)
    return out


def _gather(cache: np.ndarray, blocks: np.ndarray, length: int) -> np.ndarray:
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length].astype(np.float32)


register_op("rope", _infer_rope, _rope, ELEMENTWISE)  # pairs elements within a head: elementwise per row
register_op("kv_write", _infer_kv_write, _kv_write, CACHE_WRITE, mutates=(0, 1))
register_op("paged_attention", _infer_attention, _attention, ATTENTION)
