"""What the scheduler's steps ran: running counts (for /metrics) and the last step's line (for the serving
trace)."""

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests, cached or not
    generation_tokens: int = 0
    prefill_tokens: int = 0  # tokens computed in prefill chunks, recomputes after preemption included
    preemptions: int = 0
    steps: int = 0
    step_tokens: Counter[int] = field(default_factory=Counter)  # engine steps by tokens run; /metrics buckets them
    spec_drafts: int = 0  # speculative verifications: a sequence's drafts checked in a step
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_by_position: Counter[int] = field(default_factory=Counter)  # drafts kept at position 0, 1, ...


@dataclass(frozen=True)
class StepRecord:
    """What one engine step ran and how long the engine took over it (the serving trace's line)."""
    start: float  # time.monotonic() when the engine was called
    seconds: float
    seqs: int
    tokens: int
    prefill_tokens: int  # tokens of prompt chunks (and recomputes); the rest are one decode token per sequence
    outputs: int  # tokens handed to requests
