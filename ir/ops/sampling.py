"""The `sample` op: one token per row of logits, drawn by the Gumbel-max trick over a counter-based RNG, so that
this NumPy reference and the GPU kernels (backends/triton/kernels/sampling.py) pick the same token for the same
seed. Each token id's noise is Philox4x32-10 of the counter (token id, step, 0, 0) under the row's 64-bit seed
as key: no state, any order of evaluation, and a different stream per step of a request.

A row samples from softmax(logits / T) restricted to the set that min-p, top-k and top-p keep (in vLLM's order:
min-p relative to the most likely token, then top-k, then top-p over what is left, renormalised). Every one of
them keeps a prefix of the tokens ranked by logit (ties to the lower id), so the set is that prefix's length n,
and the token is argmax over it of logits / T + Gumbel noise, which is an exact draw from the renormalised
distribution. Top-p's running masses are summed in 40-bit fixed point, so the sum is exact in any order and the
kernels cut where this reference does. T below GREEDY_BELOW is greedy.

The kernels see only the top `candidates` tokens of a row (and its full-vocabulary statistics); a row whose set
may reach past them is left unresolved (token -1) for the host to draw from the full row with `sample_row` and
no candidate limit, which gives the token that unlimited candidates would. The reference marks the same rows.
"""

import numpy as np

from pegainfer.ir.dtypes import FP32, INT32, INT64, dtype_from_name
from pegainfer.ir.registry import ROW_REDUCTION, expect, register_op
from pegainfer.ir.types import TensorType

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily, as in vLLM: dividing by them overflows
TOP_P_SLACK = 1e-6  # a token whose preceding mass misses top_p by rounding alone stays out
FIXED_ONE = 2.0 ** 40  # top-p masses in fixed point: a weight in (0, 1] times this, truncated to an integer
UNRESOLVED = -1  # the token of a row whose kept set reaches past the candidates
HOST_PREFIX = 4096  # ranked tokens the host tries first for a row left to it, before the whole row
PHILOX_ROUNDS = 10
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Salmon et al. 2011, Philox4x32: multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # and the key schedule's Weyl constants
_UNIT = np.float32(2.0 ** -23)


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[np.ndarray, np.ndarray],
               rounds: int = PHILOX_ROUNDS) -> tuple[np.ndarray, ...]:
    """Philox4x32-`rounds` of uint32 arrays (four counter words, two key words), elementwise."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    k0, k1 = (np.broadcast_to(np.asarray(k, dtype=np.uint32), c0.shape).copy() for k in key)
    m0, m1 = np.uint64(_PHILOX_M[0]), np.uint64(_PHILOX_M[1])
    for _ in range(rounds):
        p0, p1 = m0 * c0.astype(np.uint64), m1 * c2.astype(np.uint64)
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0, p1.astype(np.uint32),
                          (p0 >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1, p0.astype(np.uint32))
        k0, k1 = k0 + np.uint32(_PHILOX_W[0]), k1 + np.uint32(_PHILOX_W[1])  # arrays: wraps silently
    return c0, c1, c2, c3


def gumbel(seed, step, ids: np.ndarray) -> np.ndarray:
    """float32 Gumbel noise of token `ids` at `step` of the stream keyed by `seed` (taken modulo 2**64; arrays of
    seeds and steps broadcast against `ids`, int64 seeds as their bits). The uniform is (23 random bits + 0.5) /
    2**23: strictly inside (0, 1), so the noise is always finite."""
    if isinstance(seed, (int, np.integer)):
        seed = np.uint64(int(seed) % 2 ** 64)
    seed = np.asarray(seed).astype(np.uint64)
    ids = np.asarray(ids, dtype=np.int64)
    shape = np.broadcast_shapes(ids.shape, seed.shape, np.shape(step))
    zeros = np.zeros(shape, dtype=np.uint32)
    bits = philox4x32((np.broadcast_to(ids.astype(np.uint32), shape), np.broadcast_to(np.asarray(step), shape),
                       zeros, zeros),
                      ((seed & np.uint64(0xFFFFFFFF)).astype(np.uint32), (seed >> np.uint64(32)).astype(np.uint32)))[0]
    uniform = ((bits >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * _UNIT
    return -np.log(-np.log(uniform))


def _rank_keys(x: np.ndarray) -> np.ndarray:
    """The kernels' sort keys: the float bits made order-preserving as integers (so +0.0 ranks above -0.0)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.int32)
    return np.where(bits >= 0, bits, bits ^ np.int32(0x7FFFFFFF)).astype(np.int64)


def ranked_prefix(x: np.ndarray, length: int) -> np.ndarray:
    """The first `length` token ids by descending logit, ties to the lower id (the kernels' key order), found
    without sorting the whole row: the keys, with the inverted id below the float bits, are all distinct."""
    keys = (_rank_keys(x) << 32) | (0x7FFFFFFF - np.arange(x.size, dtype=np.int64))
    top = np.argpartition(keys, x.size - length)[x.size - length:] if length < x.size else np.arange(x.size)
    return top[np.argsort(keys[top])[::-1]]


def _lead(mask: np.ndarray) -> int:
    """How many leading elements are true."""
    return int(np.argmin(mask)) if not mask.all() else int(mask.size)


def effective_top_k(top_k, vocab: int):
    return np.where((top_k > 0) & (top_k < vocab), top_k, vocab)


def sample_rows(x: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                seed: np.ndarray, step: np.ndarray, candidates: int | None = None) -> np.ndarray:
    """The tokens rows of float32 logits sample, UNRESOLVED for a row that the kernels, seeing only `candidates`
    top tokens (when given), cannot settle. Greedy rows and rows that cut nothing go in one batch each."""
    x = np.asarray(x, dtype=np.float32)
    rows, vocab = x.shape
    params = [np.broadcast_to(np.asarray(a), (rows,)) for a in (temperature, top_k, top_p, min_p, seed, step)]
    temperature, top_k, top_p, min_p, seed, step = params
    greedy = temperature < GREEDY_BELOW
    whole = ~greedy & (effective_top_k(top_k, vocab) == vocab) & (top_p >= 1) & (min_p <= 0)
    tokens = np.argmax(_rank_keys(x), axis=1).astype(np.int32)  # the first of the top keys: greedy's choice
    if whole.any():  # nothing cut: Gumbel-max over the whole vocabulary
        scaled = x[whole] / temperature[whole, None].astype(np.float32)
        noise = gumbel(seed[whole, None], step[whole, None], np.arange(vocab)[None, :])
        tokens[whole] = np.argmax(scaled + noise, axis=1)
    cut = np.flatnonzero(~greedy & ~whole)
    kept = [_kept_tokens(x[r], float(temperature[r]), int(top_k[r]), float(top_p[r]), float(min_p[r]), candidates)
            for r in cut]
    tokens[[r for r, ids in zip(cut, kept) if ids is None]] = UNRESOLVED
    settled = [(r, ids) for r, ids in zip(cut, kept) if ids is not None]
    if settled:  # one batch of noise for every kept token of every cut row: Gumbel-max over each kept prefix
        owner = np.concatenate([np.full(ids.size, r) for r, ids in settled])
        ids = np.concatenate([ids for _, ids in settled])
        scores = x[owner, ids] / temperature[owner].astype(np.float32) + gumbel(seed[owner], step[owner], ids)
        start = 0
        for r, row_ids in settled:
            row_scores = scores[start: start + row_ids.size]
            tokens[r] = row_ids[row_scores == row_scores.max()].min()
            start += row_ids.size
    return tokens


def sample_row(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, step: int,
               candidates: int | None = None) -> int:
    """One row's token (see sample_rows)."""
    return int(sample_rows(np.asarray(x)[None], temperature, top_k, top_p, min_p,
                           np.array([int(seed) % 2 ** 64], dtype=np.uint64).view(np.int64), step, candidates)[0])


def _kept_tokens(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
                 candidates: int | None) -> np.ndarray | None:
    """The ids a row that min-p, top-k or top-p cut keeps (a prefix of the ranked tokens), or None when the
    kernels, seeing `candidates` top tokens, cannot tell it. Without a limit, the first HOST_PREFIX ranked tokens
    are tried before the whole row."""
    vocab = x.size
    s = x / np.float32(temperature)
    whole_mass = np.float32(np.exp(s - s.max()).sum(dtype=np.float32)) if top_p < 1 else np.float32(1)
    for length in (candidates,) if candidates is not None else (HOST_PREFIX, vocab):
        order = ranked_prefix(x, min(length, vocab))
        kept = _kept_prefix(s[order], vocab, int(effective_top_k(top_k, vocab)), np.float32(top_p),
                            np.float32(min_p), whole_mass)
        if kept is not None:
            return order[:kept]
    return None


def _kept_prefix(ranked: np.ndarray, vocab: int, k_eff: int, top_p: np.float32, min_p: np.float32,
                 whole_mass: np.float32) -> int | None:
    """How many of the first ranked tokens (logits / T of a prefix of the rank order) min-p, top-k and top-p
    keep, or None when that may reach past the prefix. `whole_mass`: sum of exp(logits / T - max) over the
    vocabulary, a float sum in any order as the kernels take it; every other mass is exact, in fixed point."""
    length = ranked.size
    weights = np.exp(ranked - ranked[0])  # probability relative to the most likely token's
    fixed = (weights * np.float32(FIXED_ONE)).astype(np.int64)
    n1 = max(1, min(k_eff, _lead(weights >= min_p)))  # kept by min-p and top-k, counted within the prefix
    whole = n1 == vocab or (k_eff == vocab and min_p <= 0)  # ... which keep every token
    if not (n1 < length or k_eff <= length or whole):
        return None
    if top_p >= 1:
        return n1
    mass = whole_mass * np.float32(FIXED_ONE) if whole else np.float32(fixed[:n1].sum())
    threshold = np.int64((top_p - np.float32(TOP_P_SLACK)) * mass)
    before = np.cumsum(fixed) - fixed  # mass ranked above each token
    n = min(n1, max(1, _lead(before < threshold)))
    return None if whole and vocab > length and n >= length else n


def logsumexp_row(x: np.ndarray) -> np.float32:
    peak = x.max()
    return np.float32(peak + np.log(np.exp(x - peak).sum(dtype=np.float32)))


def _infer_sample(logits: TensorType, temperature: TensorType, top_k: TensorType, top_p: TensorType,
                  min_p: TensorType, seed: TensorType, step: TensorType, scored: TensorType | None = None, *,
                  candidates: int, logits_dtype: str | None = None) -> tuple[TensorType, TensorType]:
    expect(logits.rank == 2 and logits.dtype.is_float and isinstance(logits.shape[1], int),
           f"sample: logits must be float [rows, vocab], found {logits}")
    expect(scored is None or (scored.shape == logits.shape and scored.dtype.is_float),
           f"sample: the scored logits must be float {list(logits.shape)}, found {scored}")
    rows = logits.shape[0]
    for name, t, dtype in (("temperature", temperature, FP32), ("top_k", top_k, INT32), ("top_p", top_p, FP32),
                           ("min_p", min_p, FP32), ("seed", seed, INT64), ("step", step, INT32)):
        expect(t == TensorType(dtype, (rows,)), f"sample: {name} must be {TensorType(dtype, (rows,))}, found {t}")
    expect(candidates > 0, f"sample: candidates must be positive, found {candidates}")
    expect(logits_dtype is None or dtype_from_name(logits_dtype) == logits.dtype,
           f"sample: logits_dtype {logits_dtype} must be the logits' dtype {logits.dtype}")
    return TensorType(INT32, (rows,)), TensorType(FP32, (rows,))


def _sample(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
            seed: np.ndarray, step: np.ndarray, scored: np.ndarray | None = None, *, candidates: int,
            logits_dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, the chosen tokens' logprobs of the unscaled distribution of `scored`, the logits themselves where
    none: the draw's logits may be penalised ones, scored by the logits before the penalties as vLLM's raw
    logprobs are); UNRESOLVED and NaN for rows the candidates cannot settle, or where the logits allow no token.
    `logits_dtype`: the logits are read as stored in it (rounded), as the kernels do."""
    x = np.asarray(logits, dtype=np.float32)
    if logits_dtype is not None:
        x = x.astype(dtype_from_name(logits_dtype).np_dtype).astype(np.float32)
    tokens = sample_rows(x, temperature, top_k, top_p, min_p, seed, step, candidates)
    tokens[~np.isfinite(x).any(axis=1)] = UNRESOLVED
    resolved = tokens != UNRESOLVED
    x = x if scored is None else np.asarray(scored, dtype=np.float32)
    peak = x.max(axis=1, keepdims=True)
    lse = peak[:, 0] + np.log(np.exp(x - peak).sum(axis=1, dtype=np.float32))
    logprobs = np.full(x.shape[0], np.nan, dtype=np.float32)
    logprobs[resolved] = x[resolved, tokens[resolved]] - lse[resolved]
    return tokens, logprobs


register_op("sample", _infer_sample, _sample, ROW_REDUCTION)


def _infer_mask_tokens(logits: TensorType, bitmask: TensorType, index: TensorType) -> TensorType:
    expect(logits.rank == 2 and logits.dtype.is_float and isinstance(logits.shape[1], int),
           f"mask_tokens: logits must be float [rows, vocab], found {logits}")
    expect(bitmask.rank == 2 and bitmask.dtype == INT32, f"mask_tokens: the bitmask must be i32 [masks, words], "
           f"found {bitmask}")
    expect(index == TensorType(INT32, (logits.shape[0],)),
           f"mask_tokens: the index must be {TensorType(INT32, (logits.shape[0],))}, found {index}")
    return logits


def mask_tokens(logits: np.ndarray, bitmask: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Each row whose index is a bitmask row keeps the ids whose bit is set there (id j: bit j % 32 of word
    j // 32, xgrammar's layout) and has -inf for the rest; a row of index -1 is left alone."""
    x = np.array(logits, copy=True)
    ids = np.arange(x.shape[1])
    for row in np.flatnonzero(np.asarray(index) >= 0):
        words = np.asarray(bitmask[index[row]]).view(np.uint32)
        x[row, ((words[ids // 32] >> (ids % 32).astype(np.uint32)) & 1) == 0] = -np.inf
    return x


register_op("mask_tokens", _infer_mask_tokens, mask_tokens, ROW_REDUCTION)


def _infer_penalize_tokens(logits: TensorType, start: TensorType, count: TensorType, ids: TensorType,
                           terms: TensorType) -> TensorType:
    expect(logits.rank == 2 and logits.dtype.is_float and isinstance(logits.shape[1], int),
           f"penalize_tokens: logits must be float [rows, vocab], found {logits}")
    for name, t in (("start", start), ("count", count)):
        expect(t == TensorType(INT32, (logits.shape[0],)),
               f"penalize_tokens: {name} must be {TensorType(INT32, (logits.shape[0],))}, found {t}")
    expect(ids.rank == 1 and ids.dtype == INT32, f"penalize_tokens: ids must be i32 [entries], found {ids}")
    expect(terms == TensorType(FP32, (ids.shape[0], 3)),
           f"penalize_tokens: terms must be {TensorType(FP32, (ids.shape[0], 3))}, found {terms}")
    return TensorType(FP32, logits.shape)


def penalize_tokens(logits: np.ndarray, start: np.ndarray, count: np.ndarray, ids: np.ndarray,
                    terms: np.ndarray) -> np.ndarray:
    """Each row's penalties as sparse terms (runtime/constraint.py's PenaltyState.terms): for entries start[r] ..
    start[r] + count[r] - 1, the logit of id j becomes y - s with y = x + bias divided by the repetition factor
    where positive and multiplied by it otherwise, s the presence and frequency subtrahend (+inf: masked): the
    operations of ir/ops/penalties.py's penalize in its order, in float32, which the result stays in."""
    x = np.array(logits, dtype=np.float32, copy=True)
    for row in np.flatnonzero(np.asarray(count) > 0):
        entries = slice(int(start[row]), int(start[row]) + int(count[row]))
        j = np.asarray(ids[entries])
        bias, factor, minus = (np.asarray(terms[entries, k], dtype=np.float32) for k in range(3))
        y = x[row, j] + bias
        x[row, j] = np.where(y > 0, y / factor, y * factor) - minus
    return x


register_op("penalize_tokens", _infer_penalize_tokens, penalize_tokens, ROW_REDUCTION)
