"""The sampler tail over each row of logits, in three launches: many programs per row each reduce a chunk of the
vocabulary, first to its logsumexp statistics and its largest key, then to its share of the row's top-K keys
(only keys at or above the K-th largest chunk maximum can be among them, so most blocks merge a few column maxima
or nothing instead of being ranked whole) and of what the row's draw needs; then one program per row merges
them, writes the top-K values and ids (ranked only for a row that asks top logprobs or samples with a cut; a row
that asks none gets its largest alone) and the logsumexp, and draws the row's token by the `sample` op's rule
(ir/ops/sampling.py, whose NumPy reference this follows operation for operation), all of it over the logits a
row's grammar mask leaves (mask_tokens: the others -inf), penalised (penalize_tokens: a row's sparse terms applied
to the ids of each block they fall in) for the ranking and the draw, not for the logsumexp and the logprobs.
Top-k runs on 64-bit keys that pack an order-preserving form of the float with the inverted column, so one
tl.topk keeps values and ids together and breaks ties toward the lower id, as the reference does.

A sampling row's token is argmax(logits / T + Gumbel noise) over the tokens it keeps. When nothing is cut the
argmax runs over the whole vocabulary in the chunk programs; otherwise over the top-K candidates in the merge,
which marks the row unresolved (-1) when its kept set may reach past them."""

import triton
import triton.language as tl


@triton.jit
def _keys(x, offs, inside):
    lowest = -9223372036854775807 - 1
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return tl.where(inside, (ordered << 32) | (0x7FFFFFFF - offs).to(tl.int64), lowest)


@triton.jit
def _gumbel(seed, step, ids):
    """Gumbel noise of token `ids`: Philox4x32-10 of the counter (id, step, 0, 0) under the key (seed's low and
    high words), first word; its top 23 bits + 0.5 over 2**23 as a uniform strictly inside (0, 1)."""
    key = seed.to(tl.uint64)
    k0 = (key & 0xFFFFFFFF).to(tl.uint32)
    k1 = (key >> 32).to(tl.uint32)
    c0 = ids.to(tl.uint32)
    c1 = c0 * 0 + step.to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    for _ in tl.static_range(10):
        p0, p2 = c0, c2
        c0 = tl.umulhi(p2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(p0, 0xD2511F53) ^ c3 ^ k1
        c1 = tl.mul(p2, 0xCD9E8D57, sanitize_overflow=False)
        c3 = tl.mul(p0, 0xD2511F53, sanitize_overflow=False)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    uniform = ((c0 >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    return -tl.log(-tl.log(uniform))


@triton.jit
def _effective_top_k(top_k, VOCAB: tl.constexpr):
    return tl.where((top_k > 0) & (top_k < VOCAB), top_k, VOCAB)


@triton.jit
def _masked(row_ptr, offs, inside, bitmask_ptr, mask_row, stride_bitmask):
    """The row's logits at `offs` as float32, -inf where its grammar mask (bitmask row `mask_row`, none for -1)
    leaves an id out: bit id % 32 of word id // 32."""
    x = tl.load(row_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
    words = tl.load(bitmask_ptr + mask_row * stride_bitmask + offs // 32, mask=inside & (mask_row >= 0), other=-1)
    return tl.where(((words >> (offs % 32)) & 1) != 0, x, float("-inf"))


@triton.jit
def _entries_before(ids_ptr, first, last, value, SCAN: tl.constexpr):
    """The first of the row's penalty entries first .. last - 1 (ascending ids) whose id is at least `value`."""
    below = first * 0
    for start in range(first, last, SCAN):
        e = start + tl.arange(0, SCAN)
        below += tl.sum(((e < last) & (tl.load(ids_ptr + e, mask=e < last, other=0) < value)).to(tl.int32), axis=0)
    return first + below


@triton.jit
def _penalized(x, offs, start, ids_ptr, terms_ptr, first, last, BLOCK: tl.constexpr, SCAN: tl.constexpr):
    """The block of logits x (ids offs, from `start`) with the row's penalty entries first .. last - 1 that fall
    in it applied, as penalize_tokens does: (x + bias) divided by the factor where positive, else multiplied by
    it, less the subtrahend; a row without entries is returned as it is."""
    for e in range(_entries_before(ids_ptr, first, last, start, SCAN),
                   _entries_before(ids_ptr, first, last, start + BLOCK, SCAN)):
        y = x + tl.load(terms_ptr + 3 * e)
        factor = tl.load(terms_ptr + 3 * e + 1)
        y = tl.where(y > 0, tl.div_rn(y, factor), y * factor) - tl.load(terms_ptr + 3 * e + 2)
        x = tl.where(offs == tl.load(ids_ptr + e), y, x)
    return x


@triton.jit
def _row_of(row, logits_ptr, stride_logits, mask_index_ptr, penalty_start_ptr, penalty_count_ptr):
    """The row's logits, its bitmask row (-1: none) and the span of its penalty entries."""
    first = tl.load(penalty_start_ptr + row)
    return (logits_ptr + row * stride_logits, tl.load(mask_index_ptr + row), first,
            first + tl.load(penalty_count_ptr + row))


@triton.jit
def tail_bound_kernel(logits_ptr, bitmask_ptr, mask_index_ptr, penalty_start_ptr, penalty_count_ptr, penalty_ids_ptr,
                      penalty_terms_ptr, stats_ptr, bound_ptr, stride_logits, stride_bitmask, VOCAB: tl.constexpr,
                      CHUNK: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr):
    """Per (row, chunk): the max and sum of exp of the logits the row's grammar mask leaves, and the chunk's
    largest key of them penalised. A row's top K keys are none below the K-th largest of its chunks' largest."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    row_ptr, mask_row, first, last = _row_of(row, logits_ptr, stride_logits, mask_index_ptr, penalty_start_ptr,
                                             penalty_count_ptr)
    running_max = tl.full([1], float("-inf"), tl.float32)
    running_sum = tl.zeros([1], tl.float32)
    top = tl.full([1], -9223372036854775807 - 1, tl.int64)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < VOCAB
        x = _masked(row_ptr, offs, inside, bitmask_ptr, mask_row, stride_bitmask)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe) + tl.sum(tl.exp(x - safe), axis=0)
        running_max = new_max
        penalized = _penalized(x, offs, start, penalty_ids_ptr, penalty_terms_ptr, first, last, BLOCK, SCAN)
        top = tl.maximum(top, tl.max(_keys(penalized, offs, inside), axis=0))
    slot = row * CHUNKS + chunk
    tl.store(stats_ptr + slot * 5 + tl.arange(0, 1), running_max)
    tl.store(stats_ptr + slot * 5 + 1 + tl.arange(0, 1), running_sum)
    tl.store(bound_ptr + slot + tl.arange(0, 1), top)


@triton.jit
def _ranked(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, wanted_ptr, VOCAB: tl.constexpr,
            GREEDY_BELOW: tl.constexpr):
    """Whether the row's top K is ranked: it asks for top logprobs, or it samples with a cut (top-k, top-p or
    min-p), whose kept set is a prefix of them. A greedy row's token is its largest key, which the bounds hold."""
    cut = ((_effective_top_k(tl.load(top_k_ptr + row), VOCAB) < VOCAB) | (tl.load(top_p_ptr + row) < 1.0)
           | (tl.load(min_p_ptr + row) > 0.0))
    return (tl.load(wanted_ptr + row) > 0) | ((tl.load(temperature_ptr + row) >= GREEDY_BELOW) & cut)


@triton.jit
def _candidate_floor(bound_ptr, row, K: tl.constexpr, K_P2: tl.constexpr, CHUNKS: tl.constexpr,
                     CHUNKS_P2: tl.constexpr):
    """The K-th largest of the row's chunk maxima (tail_bound_kernel), or the lowest key where the row has fewer
    than K chunks."""
    lowest = -9223372036854775807 - 1
    if CHUNKS >= K:
        chunks = tl.arange(0, CHUNKS_P2)
        ranked = tl.topk(tl.load(bound_ptr + row * CHUNKS + chunks, mask=chunks < CHUNKS, other=lowest), K_P2)
        floor = tl.min(tl.where(tl.arange(0, K_P2) < K, ranked, 9223372036854775807), axis=0)
    else:
        floor = tl.min(tl.full([1], lowest, tl.int64), axis=0)
    return floor


@triton.jit
def _merge_candidates(best, keys, floor, K_P2: tl.constexpr, BLOCK: tl.constexpr):
    """`best` (the top K_P2 keys so far) merged with a block's keys at or above `floor`. Where no column of the
    block seen as [BLOCK / K_P2, K_P2] holds two of them, its column maxima carry them all into a merge of 2 K_P2
    keys; only a crowded block is ranked whole, and a block with none is skipped."""
    lowest = -9223372036854775807 - 1
    above = keys >= floor
    crowded = tl.max(tl.sum(tl.reshape(above.to(tl.int32), [BLOCK // K_P2, K_P2]), axis=0), axis=0)
    if crowded == 1:
        columns = tl.max(tl.reshape(tl.where(above, keys, lowest), [BLOCK // K_P2, K_P2]), axis=0)
        best = tl.topk(tl.reshape(tl.join(best, columns), [2 * K_P2]), K_P2)
    elif crowded > 1:
        best = tl.topk(tl.reshape(tl.join(best, tl.topk(keys, K_P2)), [2 * K_P2]), K_P2)
    return best


@triton.jit
def tail_partial_kernel(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr,
                        wanted_ptr, bitmask_ptr, mask_index_ptr, penalty_start_ptr, penalty_count_ptr,
                        penalty_ids_ptr, penalty_terms_ptr, bound_ptr, keys_ptr, count_ptr, stats_ptr, best_ptr,
                        stride_logits, stride_bitmask, VOCAB: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr,
                        CHUNK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK: tl.constexpr,
                        SCAN: tl.constexpr, GREEDY_BELOW: tl.constexpr):
    """Per (row, chunk), for a row whose top K is wanted or whose draw is cut (_ranked): the chunk's top K_P2 keys
    of those that can be among the row's top K, and how many of those there are; for every row, stats (max and sum
    of exp of logits / T when the row's top-p needs the whole vocabulary's mass; the best logits / T + noise when
    nothing is cut), and the id of that best; all over the logits the row's grammar mask leaves, penalised."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    row_ptr, mask_row, first, last = _row_of(row, logits_ptr, stride_logits, mask_index_ptr, penalty_start_ptr,
                                             penalty_count_ptr)
    best = tl.full([K_P2], -9223372036854775807 - 1, tl.int64)
    count = tl.zeros([1], tl.int32)
    if _ranked(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, wanted_ptr, VOCAB, GREEDY_BELOW):
        floor = _candidate_floor(bound_ptr, row, K, K_P2, CHUNKS, CHUNKS_P2)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < VOCAB
            x = _masked(row_ptr, offs, inside, bitmask_ptr, mask_row, stride_bitmask)
            keys = _keys(_penalized(x, offs, start, penalty_ids_ptr, penalty_terms_ptr, first, last, BLOCK, SCAN),
                         offs, inside)
            best = _merge_candidates(best, keys, floor, K_P2, BLOCK)
            count += tl.sum((keys >= floor).to(tl.int32), axis=0)

    temperature = tl.load(temperature_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    whole_vocab = (temperature >= GREEDY_BELOW) & (_effective_top_k(tl.load(top_k_ptr + row), VOCAB) == VOCAB)
    t_max = tl.full([1], float("-inf"), tl.float32)
    t_sum = tl.zeros([1], tl.float32)
    best_score = tl.full([1], float("-inf"), tl.float32)
    best_id = tl.zeros([1], tl.int32) + chunk * CHUNK
    if whole_vocab & (top_p < 1.0):  # top-p over the whole vocabulary: its mass relative to the top logit / T
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _masked(row_ptr, offs, offs < VOCAB, bitmask_ptr, mask_row, stride_bitmask)
            x = _penalized(x, offs, start, penalty_ids_ptr, penalty_terms_ptr, first, last, BLOCK, SCAN)
            s = tl.div_rn(x, temperature)
            new_max = tl.maximum(t_max, tl.max(s, axis=0))
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            t_sum = t_sum * tl.exp(t_max - safe) + tl.sum(tl.exp(s - safe), axis=0)
            t_max = new_max
    if whole_vocab & (top_p >= 1.0) & (min_p <= 0.0):  # nothing cut: Gumbel-max over the chunk
        seed = tl.load(seed_ptr + row)
        step = tl.load(step_ptr + row)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < VOCAB
            x = _masked(row_ptr, offs, inside, bitmask_ptr, mask_row, stride_bitmask)
            x = _penalized(x, offs, start, penalty_ids_ptr, penalty_terms_ptr, first, last, BLOCK, SCAN)
            score = tl.where(inside, tl.div_rn(x, temperature) + _gumbel(seed, step, offs), float("-inf"))
            block_best = tl.max(score, axis=0)
            better = block_best > best_score  # strictly: an earlier block (lower ids) wins a tie
            best_id = tl.where(better, start + tl.argmax(score, axis=0, tie_break_left=True), best_id)
            best_score = tl.where(better, block_best, best_score)
    slot = row * CHUNKS + chunk
    tl.store(keys_ptr + slot * K_P2 + tl.arange(0, K_P2), best)
    tl.store(count_ptr + slot + tl.arange(0, 1), count)
    tl.store(stats_ptr + slot * 5 + 2 + tl.arange(0, 1), t_max)
    tl.store(stats_ptr + slot * 5 + 3 + tl.arange(0, 1), t_sum)
    tl.store(stats_ptr + slot * 5 + 4 + tl.arange(0, 1), best_score)
    tl.store(best_ptr + slot + tl.arange(0, 1), best_id)


@triton.jit
def _leading(condition, rank, K: tl.constexpr):
    """How many leading ranks (of K) satisfy `condition`."""
    return tl.min(tl.where((rank < K) & (condition == 0), rank, K), axis=0)


@triton.jit
def _merge_stats(stats_ptr, row, field, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """sum over chunks of sum_c * exp(max_c - max) and that max, for the (max, sum) pair at `field`."""
    chunks = tl.arange(0, CHUNKS_P2)
    maxes = tl.load(stats_ptr + (row * CHUNKS + chunks) * 5 + field, mask=chunks < CHUNKS, other=float("-inf"))
    sums = tl.load(stats_ptr + (row * CHUNKS + chunks) * 5 + field + 1, mask=chunks < CHUNKS, other=0.0)
    peak = tl.max(maxes, axis=0)
    safe = tl.where(peak == float("-inf"), 0.0, peak)
    return tl.sum(sums * tl.exp(tl.where(chunks < CHUNKS, maxes - safe, float("-inf"))), axis=0), peak


@triton.jit
def _row_candidates(keys_ptr, count_ptr, row, K_P2: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr,
                    LEAD: tl.constexpr):
    """The row's top K_P2 keys from its chunks' ranked candidates: from the first LEAD of each where no chunk
    holds more (the usual case), else from all of them."""
    lowest = -9223372036854775807 - 1
    chunks = tl.arange(0, CHUNKS_P2)
    offs = tl.arange(0, CHUNKS_P2 * K_P2)
    if CHUNKS_P2 * LEAD >= K_P2:
        counts = tl.load(count_ptr + row * CHUNKS + chunks, mask=chunks < CHUNKS, other=0)
        if tl.max(counts, axis=0) <= LEAD:
            lead = tl.reshape(chunks[:, None] * K_P2 + tl.arange(0, LEAD)[None, :], [CHUNKS_P2 * LEAD])
            top = tl.topk(tl.load(keys_ptr + row * CHUNKS * K_P2 + lead, mask=lead < CHUNKS * K_P2, other=lowest),
                          K_P2)
        else:
            top = tl.topk(tl.load(keys_ptr + row * CHUNKS * K_P2 + offs, mask=offs < CHUNKS * K_P2, other=lowest),
                          K_P2)
    else:
        top = tl.topk(tl.load(keys_ptr + row * CHUNKS * K_P2 + offs, mask=offs < CHUNKS * K_P2, other=lowest), K_P2)
    return top


@triton.jit
def tail_merge_kernel(keys_ptr, count_ptr, stats_ptr, best_ptr, bound_ptr, logits_ptr, temperature_ptr, top_k_ptr,
                      top_p_ptr, min_p_ptr, seed_ptr, step_ptr, wanted_ptr, values_ptr, ids_ptr, lse_ptr, tokens_ptr,
                      logprobs_ptr, stride_logits,
                      VOCAB: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, CHUNKS: tl.constexpr,
                      CHUNKS_P2: tl.constexpr, LEAD: tl.constexpr, GREEDY_BELOW: tl.constexpr,
                      TOP_P_SLACK: tl.constexpr, FIXED_ONE: tl.constexpr):
    row = tl.program_id(0)
    rank = tl.arange(0, K_P2)
    ranked = _ranked(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, wanted_ptr, VOCAB, GREEDY_BELOW)
    if ranked:
        top = _row_candidates(keys_ptr, count_ptr, row, K_P2, CHUNKS, CHUNKS_P2, LEAD)
    else:  # the row's largest key alone: the greatest of its chunks' (tail_bound_kernel)
        chunks = tl.arange(0, CHUNKS_P2)
        largest = tl.max(tl.load(bound_ptr + row * CHUNKS + chunks, mask=chunks < CHUNKS,
                                 other=-9223372036854775807 - 1), axis=0)
        top = tl.where(rank == 0, largest, -9223372036854775807 - 1)
    ordered = (top >> 32).to(tl.int32)
    valid = rank < K
    values = tl.where(valid & ((rank == 0) | ranked),
                      tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True), float("-inf"))
    ids = 0x7FFFFFFF - (top & 0xFFFFFFFF).to(tl.int32)
    shown = (rank == 0) | (tl.load(wanted_ptr + row) > 0)  # a cut row's candidates serve its draw, not the output
    tl.store(values_ptr + row * K + rank, tl.where(shown, values, float("-inf")), mask=valid)
    tl.store(ids_ptr + row * K + rank, tl.where(shown, ids, -1), mask=valid)
    total, peak = _merge_stats(stats_ptr, row, 0, CHUNKS, CHUNKS_P2)
    lse = peak + tl.log(total)
    tl.store(lse_ptr + row + tl.arange(0, 1), tl.full([1], 0.0, tl.float32) + lse)

    # The kept set: min-p, top-k, then top-p over what is left, each a prefix of the ranked candidates.
    temperature = tl.load(temperature_ptr + row)
    top_k = _effective_top_k(tl.load(top_k_ptr + row), VOCAB)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    sampling = temperature >= GREEDY_BELOW
    cut = (top_k < VOCAB) | (top_p < 1.0) | (min_p > 0.0)
    s = tl.where(valid, tl.div_rn(values, tl.where(sampling, temperature, 1.0)), float("-inf"))
    weights = tl.where(valid, tl.exp(s - tl.max(s, axis=0)), 0.0)
    fixed = (weights * FIXED_ONE).to(tl.int64)
    n1 = tl.maximum(tl.minimum(top_k, _leading(weights >= min_p, rank, K)), 1)
    whole = (n1 == VOCAB) | ((top_k == VOCAB) & (min_p <= 0.0))  # min-p and top-k keep every token
    whole_mass, _ = _merge_stats(stats_ptr, row, 2, CHUNKS, CHUNKS_P2)
    mass = tl.where(whole, whole_mass * FIXED_ONE, tl.sum(tl.where(rank < n1, fixed, 0), axis=0).to(tl.float32))
    threshold = ((top_p - TOP_P_SLACK) * mass).to(tl.int64)
    before = tl.cumsum(fixed, axis=0) - fixed
    n = tl.where(top_p < 1.0, tl.minimum(n1, tl.maximum(_leading(before < threshold, rank, K), 1)), n1)
    unresolved = ((n1 >= K) & (top_k > K) & (whole == 0)) | (whole & (VOCAB > K) & (n >= K))

    score = tl.where(rank < n, s + _gumbel(tl.load(seed_ptr + row), tl.load(step_ptr + row), ids), float("-inf"))
    cut_token = tl.min(tl.where(score == tl.max(score, axis=0), ids, 0x7FFFFFFF), axis=0)
    top_token = tl.min(tl.where(rank == 0, ids, 0x7FFFFFFF), axis=0)
    chunks = tl.arange(0, CHUNKS_P2)
    bests = tl.load(stats_ptr + (row * CHUNKS + chunks) * 5 + 4, mask=chunks < CHUNKS, other=float("-inf"))
    full_token = tl.load(best_ptr + row * CHUNKS + tl.argmax(bests, axis=0, tie_break_left=True))
    token = tl.where(sampling, tl.where(cut, tl.where(unresolved, -1, cut_token), full_token), top_token)
    token = tl.where(tl.sum(tl.where(rank == 0, values, 0.0), axis=0) == float("-inf"), -1, token)  # none allowed
    logit = tl.load(logits_ptr + row * stride_logits + tl.maximum(token, 0)).to(tl.float32)
    tl.store(tokens_ptr + row + tl.arange(0, 1), tl.zeros([1], tl.int32) + token)
    tl.store(logprobs_ptr + row + tl.arange(0, 1),
             tl.zeros([1], tl.float32) + tl.where(token >= 0, logit - lse, float("nan")))
