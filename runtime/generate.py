"""Offline generation: the serving scheduler stepped until every request is done, in the caller's thread. Serve
and generate so share one rule for sampling (inside the engine's step) and one for stopping (the scheduler's)."""

from collections.abc import Collection
from dataclasses import dataclass, field

from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.engine_api import Engine
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig
from pegainfer.runtime.speculative import Speculator


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length" (max_tokens, the context)


def offline_config(requests: list[Request], max_model_len: int | None = None) -> SchedulerConfig:
    """Every request admitted at once and every prompt prefilled in the first step; no prefix cache (nothing is
    shared between calls). `max_model_len` (the model's context) defaults to what the longest request can reach."""
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    longest = max(len(r.prompt_ids) + r.params.max_tokens for r in requests)
    return SchedulerConfig(max_num_seqs=len(requests), max_num_batched_tokens=max(prompt_tokens, len(requests)),
                           max_model_len=max_model_len or longest, prefix_cache=False)


def generate(engine: Engine, requests: list[Request], eos_ids: Collection[int],
             max_model_len: int | None = None, speculator: Speculator | None = None) -> list[Completion]:
    """One completion per request, in order. Raises RequestError for a request the scheduler refuses (bad
    parameters, a prompt past `max_model_len`, a sequence the KV pool can never hold)."""
    if not requests:
        return []
    scheduler = Scheduler(engine, frozenset(eos_ids), offline_config(requests, max_model_len), speculator)
    for index, request in enumerate(requests):
        scheduler.add(EngineRequest(str(index), list(request.prompt_ids), request.params))
    outs = [Completion(logprobs=[] if r.params.logprobs is not None else None) for r in requests]
    try:
        while scheduler.has_work():
            for token in scheduler.step():
                out = outs[int(token.request_id)]
                out.token_ids.append(token.token_id)
                if out.logprobs is not None:
                    out.logprobs.append(token.logprobs)
                out.finish_reason = token.finish_reason
    finally:  # a step that raised leaves sequences holding KV blocks of an engine the caller may reuse
        for index in range(len(requests)):
            scheduler.abort(str(index))
    return outs
