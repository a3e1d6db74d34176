"""Offline generation: prefill every prompt in one packed step, then decode all live sequences together."""

from dataclasses import dataclass, field

import numpy as np

from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.sampler import SamplingParams, sample, top_logprobs


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length" (max_tokens)


def generate(engine: ReferenceEngine, requests: list[Request], eos_ids: frozenset[int]) -> list[Completion]:
    for request in requests:
        request.params.validate()
    seqs = [Sequence(i, list(r.prompt_ids)) for i, r in enumerate(requests)]
    rngs = [np.random.default_rng(r.params.seed) for r in requests]
    outs = [Completion(logprobs=[] if r.params.logprobs is not None else None) for r in requests]
    live = list(range(len(requests)))
    chunks = [Chunk(seq, len(seq.token_ids)) for seq in seqs]
    try:
        while live:
            logits = engine.step(chunks)
            for row, i in enumerate(live):
                _append_token(seqs[i], outs[i], requests[i].params, logits[row], rngs[i], eos_ids)
            live = [i for i in live if outs[i].finish_reason is None]
            chunks = [Chunk(seqs[i], 1) for i in live]
    finally:
        for seq in seqs:
            engine.release(seq)
    return outs


def _append_token(seq: Sequence, out: Completion, params: SamplingParams, logits: np.ndarray,
                  rng: np.random.Generator, eos_ids: frozenset[int]) -> None:
    token = sample(logits, params, rng)
    out.token_ids.append(token)
    seq.token_ids.append(token)
    if out.logprobs is not None:
        out.logprobs.append(top_logprobs(logits, params.logprobs, token))
    if token in eos_ids and not params.ignore_eos:
        out.finish_reason = "stop"
    elif len(out.token_ids) >= params.max_tokens:
        out.finish_reason = "length"
