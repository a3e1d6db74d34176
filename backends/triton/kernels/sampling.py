"""The sampler's reductions over each row of logits: logsumexp (online) and the top K values with their ids.
Top-k runs on 64-bit keys that pack an order-preserving form of the float with the inverted column, so one
tl.topk keeps values and ids together and breaks ties toward the lower id, as the reference does."""

import triton
import triton.language as tl


@triton.jit
def top_k_logsumexp_kernel(logits_ptr, values_ptr, ids_ptr, lse_ptr, stride_logits,
                           VOCAB: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lowest = -9223372036854775807 - 1
    running_max = tl.full([1], float("-inf"), tl.float32)
    running_sum = tl.zeros([1], tl.float32)
    best = tl.full([K_P2], lowest, tl.int64)
    for start in range(0, VOCAB, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < VOCAB
        x = tl.load(logits_ptr + row * stride_logits + offs, mask=inside, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
        bits = x.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        keys = tl.where(inside, (ordered << 32) | (0x7FFFFFFF - offs).to(tl.int64), lowest)
        best = tl.topk(tl.reshape(tl.join(best, tl.topk(keys, K_P2)), [2 * K_P2]), K_P2)
    ordered = (best >> 32).to(tl.int32)
    values = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    ids = 0x7FFFFFFF - (best & 0xFFFFFFFF).to(tl.int32)
    keep = tl.arange(0, K_P2) < K
    tl.store(values_ptr + row * K + tl.arange(0, K_P2), values, mask=keep)
    tl.store(ids_ptr + row * K + tl.arange(0, K_P2), ids, mask=keep)
    tl.store(lse_ptr + row + tl.arange(0, 1), running_max + tl.log(running_sum))
