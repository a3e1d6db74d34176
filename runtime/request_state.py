"""The scheduler's record of one request (runtime/scheduler.py): its sequence, what of it is cached, how far it has
generated, and what a step in flight holds of it (drafts being verified, a spare state row, draws not read yet)."""

from collections import deque
from dataclasses import dataclass, field

from pegainfer.runtime.batch import Sequence
from pegainfer.runtime.prefix_cache import ROOT
from pegainfer.runtime.requests import EngineRequest


@dataclass(eq=False)  # compared by identity: `in self.running` ran a field-by-field __eq__ per running request
class RequestState:
    request: EngineRequest
    seq: Sequence
    block_hashes: list[bytes] = field(default_factory=list)  # of the sequence's full, computed blocks
    num_generated: int = 0
    num_cached_tokens: int = 0
    generated_snapshot: bytes | None = None  # the boundary of its latest state snapshot past the prompt
    unnamed_snapshots: list[tuple[int, int]] = field(default_factory=list)  # (boundary, row): copied at launches
    admitted: bool = False
    first_scheduled: float = 0.0
    prompt_steps: list[dict[int, float]] | None = None  # prompt logprobs so far, where the request asks
    drafts: list[int] = field(default_factory=list)  # the tokens this step verifies, appended to seq.token_ids
    spare: int = -1  # the state row holding its recurrent state from before the drafts (-1: none)
    root: bytes = ROOT  # the hash before its first block: its LoRA adapter's (prefix_cache.root_for)
    restoring: list[int] = field(default_factory=list)  # cached blocks held while host blocks come back into some
    overlappable: bool = False  # whether its steps may overlap (runtime/overlap.py)
    # draws of steps in flight not read yet: (index of its PENDING token, its count of generated tokens)
    pending: deque[tuple[int, int]] = field(default_factory=deque)
    ending: bool = False  # a draw in flight reaches its length limit: no further steps

    @property
    def scoring(self) -> bool:
        """Whether its prompt chunks still run apart for their logprobs (runtime/prompt_logprobs.py)."""
        return self.request.params.prompt_logprobs is not None and self.num_generated == 0

    @property
    def group(self) -> str | int:
        """An ungrouped request is a group of its own, keyed by its sequence id (never equal to a str)."""
        return self.request.group if self.request.group is not None else self.seq.seq_id
