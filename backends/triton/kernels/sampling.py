"""The sampler's reductions over each row of logits: logsumexp and the top K values with their ids, in two
launches: many programs per row each reduce a chunk of the vocabulary, then one program per row merges them.
Top-k runs on 64-bit keys that pack an order-preserving form of the float with the inverted column, so one
tl.topk keeps values and ids together and breaks ties toward the lower id, as the reference does."""

import triton
import triton.language as tl


@triton.jit
def _keys(x, offs, inside):
    lowest = -9223372036854775807 - 1
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return tl.where(inside, (ordered << 32) | (0x7FFFFFFF - offs).to(tl.int64), lowest)


@triton.jit
def top_k_partial_kernel(logits_ptr, keys_ptr, stats_ptr, stride_logits,
                         VOCAB: tl.constexpr, K_P2: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    running_max = tl.full([1], float("-inf"), tl.float32)
    running_sum = tl.zeros([1], tl.float32)
    best = tl.full([K_P2], -9223372036854775807 - 1, tl.int64)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < VOCAB
        x = tl.load(logits_ptr + row * stride_logits + offs, mask=inside, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe) + tl.sum(tl.exp(x - safe), axis=0)
        running_max = new_max
        best = tl.topk(tl.reshape(tl.join(best, tl.topk(_keys(x, offs, inside), K_P2)), [2 * K_P2]), K_P2)
    slot = row * CHUNKS + chunk
    tl.store(keys_ptr + slot * K_P2 + tl.arange(0, K_P2), best)
    tl.store(stats_ptr + slot * 2 + tl.arange(0, 1), running_max)
    tl.store(stats_ptr + slot * 2 + 1 + tl.arange(0, 1), running_sum)


@triton.jit
def top_k_merge_kernel(keys_ptr, stats_ptr, values_ptr, ids_ptr, lse_ptr,
                       K: tl.constexpr, K_P2: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    row = tl.program_id(0)
    lowest = -9223372036854775807 - 1
    offs = tl.arange(0, CHUNKS_P2 * K_P2)
    keys = tl.load(keys_ptr + row * CHUNKS * K_P2 + offs, mask=offs < CHUNKS * K_P2, other=lowest)
    best = tl.topk(keys, K_P2)
    ordered = (best >> 32).to(tl.int32)
    values = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    ids = 0x7FFFFFFF - (best & 0xFFFFFFFF).to(tl.int32)
    keep = tl.arange(0, K_P2) < K
    tl.store(values_ptr + row * K + tl.arange(0, K_P2), values, mask=keep)
    tl.store(ids_ptr + row * K + tl.arange(0, K_P2), ids, mask=keep)
    chunks = tl.arange(0, CHUNKS_P2)
    maxes = tl.load(stats_ptr + (row * CHUNKS + chunks) * 2, mask=chunks < CHUNKS, other=float("-inf"))
    sums = tl.load(stats_ptr + (row * CHUNKS + chunks) * 2 + 1, mask=chunks < CHUNKS, other=0.0)
    peak = tl.max(maxes, axis=0)
    total = tl.sum(sums * tl.exp(tl.where(chunks < CHUNKS, maxes - peak, float("-inf"))), axis=0)
    tl.store(lse_ptr + row + tl.arange(0, 1), peak + tl.log(tl.full([1], 1.0, tl.float32) * total))
