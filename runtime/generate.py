"""Offline generation: prefill every prompt in one packed step, then decode all live sequences together. Each step
draws its tokens inside the engine (`engine.sample`), so only a few numbers per sequence come back."""

from dataclasses import dataclass, field
from typing import Protocol

from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.device_sampling import SampleResult
from pegainfer.runtime.sampler import SamplingParams


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length" (max_tokens)


class Engine(Protocol):
    """What both engines (reference_engine.ReferenceEngine, gpu.engine.GpuEngine) offer generation."""

    def sample(self, chunks: list[Chunk], params: list[SamplingParams], token_index: list[int]) -> SampleResult: ...

    def release(self, seq: Sequence) -> None: ...


def generate(engine: Engine, requests: list[Request], eos_ids: frozenset[int]) -> list[Completion]:
    for request in requests:
        request.params.validate()
    seqs = [Sequence(i, list(r.prompt_ids)) for i, r in enumerate(requests)]
    outs = [Completion(logprobs=[] if r.params.logprobs is not None else None) for r in requests]
    live = list(range(len(requests)))
    chunks = [Chunk(seq, len(seq.token_ids)) for seq in seqs]
    try:
        while live:
            drawn = engine.sample(chunks, [requests[i].params for i in live], [len(outs[i].token_ids) for i in live])
            for row, i in enumerate(live):
                _append_token(seqs[i], outs[i], requests[i].params, drawn.tokens[row], drawn.logprobs[row], eos_ids)
            live = [i for i in live if outs[i].finish_reason is None]
            chunks = [Chunk(seqs[i], 1) for i in live]
    finally:
        for seq in seqs:
            engine.release(seq)
    return outs


def _append_token(seq: Sequence, out: Completion, params: SamplingParams, token: int,
                  logprobs: dict[int, float] | None, eos_ids: frozenset[int]) -> None:
    out.token_ids.append(token)
    seq.token_ids.append(token)
    if out.logprobs is not None:
        out.logprobs.append(logprobs)
    if token in eos_ids and not params.ignore_eos:
        out.finish_reason = "stop"
    elif len(out.token_ids) >= params.max_tokens:
        out.finish_reason = "length"
