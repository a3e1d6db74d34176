"""What goes into the scheduler (a request's prompt and sampling) and what comes out of it (one token at a time)."""

import time
from dataclasses import dataclass, field

from pegainfer.runtime.constraint import TokenConstraint
from pegainfer.runtime.sampler import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.monotonic)
    group: str | None = None  # requests sharing admission fairness (an API request's choices); None: its own
    constraint: TokenConstraint | None = None  # what its tokens may be (a grammar); its own, never shared
    lora: str | None = None  # the LoRA adapter it runs with (runtime/lora.py); None: the base model
    cache_salt: str | None = None  # its prefix-cache hits only from requests with the same salt


@dataclass(frozen=True)
class TokenOutput:
    """One generated token of a request; the last one carries its finish_reason ("stop" or "length")."""
    request_id: str
    token_id: int
    logprobs: dict[int, float] | None
    finish_reason: str | None
    num_cached_tokens: int  # prompt tokens the prefix cache supplied when the request was first admitted
    time: float
    first_scheduled: float  # time.monotonic() when first admitted; a preempted and resumed request keeps it
    prompt_logprobs: list[dict[int, float]] | None = None  # on the first token, where asked: positions 1 on
