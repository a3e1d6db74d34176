"""Speculative decoding: a proposer drafts up to K tokens a sequence, the target verifies them in one packed step
(the last token and the drafts as K + 1 query tokens, a draw at each), and the drafts are kept while each equals
the target's own draw at its position; the first draw that differs (or the one after the last draft) is the next
token. Drafts are deterministic (an n-gram lookup, a drafter's argmax), so their distribution q is one point, and
keeping a draft x exactly when the target's draw y ~ p equals it is Leviathan et al.'s rejection sampling for that
q: x is kept with probability p(x) = min(1, p(x)/q(x)), and a rejection gives y ~ p restricted to y != x, which is
the normalised (p - q)+. Each draw uses the noise of its own token index (ir/ops/sampling.py), so a seeded request
gives the very tokens it gives without speculation."""

import json
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pegainfer.errors import ConfigError

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
WITH_MODEL = ("draft_model", "eagle3")  # methods whose "model" is a checkpoint of their own
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config, the keys pegainfer reads."""
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model's or head's checkpoint (draft_model, eagle3)
    prompt_lookup_min: int = 1  # n-gram: the shortest suffix looked up
    prompt_lookup_max: int = 4  # n-gram: the longest
    disable_by_batch_size: int | None = None  # no drafts in a step with more running sequences than this


def parse_speculative_config(text: str | dict) -> SpeculativeConfig:
    """The config from its JSON (or a dict), each bad key refused in one line naming it."""
    try:
        raw = json.loads(text) if isinstance(text, str) else dict(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--speculative-config: not JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--speculative-config: expected a JSON object, found {type(raw).__name__}")
    known = set(SpeculativeConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"--speculative-config: unknown key {unknown[0]!r}; pegainfer reads {sorted(known)}")
    method = raw.get("method")
    if method not in METHODS:
        raise ConfigError(f"--speculative-config: method must be one of {', '.join(METHODS)}, found {method!r}")
    k = raw.get("num_speculative_tokens")
    if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"--speculative-config: num_speculative_tokens must be an integer in "
                          f"1..{MAX_SPECULATIVE_TOKENS}, found {k!r}")
    config = SpeculativeConfig(**raw)
    if method in WITH_MODEL and not config.model:
        raise ConfigError(f"--speculative-config: method {method} needs \"model\", the draft's checkpoint folder")
    if method not in WITH_MODEL and config.model:
        raise ConfigError(f"--speculative-config: \"model\" is for {' and '.join(WITH_MODEL)}, not {method}")
    lookup = (config.prompt_lookup_min, config.prompt_lookup_max)
    if not all(_is_int(n) for n in lookup) or not 1 <= lookup[0] <= lookup[1]:
        raise ConfigError(f"--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, found "
                          f"{lookup[0]!r} and {lookup[1]!r}")
    size = config.disable_by_batch_size
    if size is not None and (not _is_int(size) or size < 1):
        raise ConfigError(f"--speculative-config: disable_by_batch_size must be a positive integer, found {size!r}")
    return config


def _is_int(value) -> bool:
    """An integer of JSON's, not a boolean (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def ngram_drafts(tokens: list[int], k: int, shortest: int, longest: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (the latest with k tokens after it, where one has), trying the longest n first; at most k of them, none where
    no suffix recurs."""
    ids = np.asarray(tokens)
    for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
        windows = sliding_window_view(ids[:-1], n)  # every n-gram that starts before the suffix does
        found = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if found.size:
            whole = found[found + n + k <= len(ids)]
            start = int((whole if whole.size else found)[-1]) + n
            return [int(t) for t in ids[start:start + k]]
    return []


def accepted_count(drafts: list[int], draws: list[int]) -> int:
    """How many leading drafts equal the target's draws at their positions (draws[i] is the target's token
    where drafts[i] was proposed; there is one draw more than drafts)."""
    assert len(draws) == len(drafts) + 1, f"{len(draws)} draws for {len(drafts)} drafts"
    count = 0
    while count < len(drafts) and drafts[count] == draws[count]:
        count += 1
    return count


@dataclass(frozen=True)
class DraftRequest:
    seq_id: int
    tokens: list[int]  # the target sequence's tokens: prompt and generated
    k: int  # drafts wanted at most


class Proposer(Protocol):
    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        """Up to each request's k draft tokens to follow its tokens."""

    def release(self, seq_id: int) -> None:
        """The target sequence is gone (finished, aborted or preempted): whatever is kept for it goes."""


@dataclass(frozen=True)
class Speculator:
    """What the scheduler speculates with (runtime/proposers.py makes the proposer)."""
    config: SpeculativeConfig
    proposer: Proposer
