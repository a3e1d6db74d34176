"""A request's constraint on the tokens it may draw (a grammar, for structured outputs and tool calls; penalties):
before each draw, the mask of allowed ids over the model's vocabulary and, where it has one, its adjustment of the
logits; after it, the token drawn. A row under a grammar is drawn in the sampler tail under its bitmask
(ir/ops/sampling.py's mask_tokens) and its penalties (penalize_tokens, from PenaltyState.terms); a row the tail
cannot take (an adjustment of another kind, top logprobs under penalties, a grammar without a bitmask) is drawn on
the host from its full logits row, adjusted, the others masked to -inf, by the `sample` op's rule and noise.
Either way its logprobs are those of the logits the grammar leaves, before penalties (vLLM's raw logprobs)."""

import logging
from typing import Protocol

import numpy as np

from pegainfer.ir.ops.penalties import Penalties, masked_ids, penalize
from pegainfer.ir.ops.sampling import GREEDY_BELOW, effective_top_k, gumbel, logsumexp_row, sample_row

LOG = logging.getLogger("pegainfer")


class TokenConstraint(Protocol):
    def allowed(self, vocab_size: int) -> np.ndarray:
        """A bool mask of the ids the next token may be (at least one true)."""

    def accept(self, token: int) -> None:
        """The token drawn; raises where the constraint did not allow it."""


class PenaltyState:
    """A sequence's penalties (ir/ops/penalties.py) and what they count: the ids of its prompt and output, and the
    output's occurrences; a TokenConstraint that allows every id and adjusts the logits."""

    def __init__(self, penalties: Penalties, prompt_ids: list[int], vocab_size: int, stop_ids: list[int]) -> None:
        self.penalties, self.stop_ids = penalties, stop_ids
        self.seen = np.zeros(vocab_size, dtype=bool)
        self.seen[[t for t in prompt_ids if t < vocab_size]] = True
        self.counts = np.zeros(vocab_size, dtype=np.float32)
        self.produced = 0
        self.output: list[int] = []
        # the ids that carry terms at every draw (biased; seen under a repetition penalty), ascending, kept as
        # tokens come so that `terms` neither scans the vocabulary nor sorts a long prompt's ids each step
        self._bias_ids = np.array([j for j, _ in penalties.logit_bias], dtype=np.int64)
        self._bias_values = np.array([b for _, b in penalties.logit_bias], dtype=np.float32)
        seen = np.flatnonzero(self.seen) if penalties.repetition != 1.0 else np.zeros(0, np.int64)
        self._ids = np.unique(np.concatenate([self._bias_ids, seen])).astype(np.int32)

    def allowed(self, vocab_size: int) -> np.ndarray:
        return np.ones(vocab_size, dtype=bool)

    def adjust(self, x: np.ndarray) -> np.ndarray:
        tail = tuple(self.output[-max((len(w) for w in self.penalties.bad_words), default=0):]) \
            if self.penalties.bad_words else ()
        return penalize(x, self.penalties, self.seen, self.counts, self.produced, self.stop_ids, tail)

    def terms(self) -> tuple[np.ndarray, np.ndarray]:
        """The next draw's penalties as sparse per-id terms (ir/ops/sampling.py's penalize_tokens, which gives what
        `adjust` gives): the ids any penalty touches, ascending, and per id (bias, repetition factor, subtrahend,
        +inf where masked)."""
        p = self.penalties
        masked = masked_ids(p, self.produced, self.stop_ids, self.output, self.counts.size)
        ids = np.union1d(self._ids, np.array(masked, np.int32)).astype(np.int32) if masked else self._ids
        counts = self.counts[ids]
        terms = np.zeros((ids.size, 3), dtype=np.float32)
        if p.logit_bias:  # as penalize's fancy-indexed add: the last bias of an id given twice
            terms[np.searchsorted(ids, self._bias_ids), 0] = self._bias_values
        terms[:, 1] = np.where(self.seen[ids], np.float32(p.repetition), np.float32(1.0))
        terms[:, 2] = np.float32(p.presence) * (counts > 0) + np.float32(p.frequency) * counts
        if masked:
            terms[np.searchsorted(ids, masked), 2] = np.inf
        return ids, terms

    def accept(self, token: int) -> None:
        if token < self.counts.size:
            p = self.penalties
            new = (p.repetition != 1.0 and not self.seen[token]) or \
                ((p.presence or p.frequency) and not self.counts[token])
            if new:
                at = int(np.searchsorted(self._ids, token))
                if at == self._ids.size or self._ids[at] != token:
                    self._ids = np.insert(self._ids, at, np.int32(token))
            self.seen[token] = True
            self.counts[token] += 1
        self.produced += 1
        self.output.append(token)


class AllowedTokens:
    """vLLM's allowed_token_ids: every token drawn from these ids alone. An adjustment of the logits (the others
    to -inf), not a grammar's mask, so that its logprobs stay the model's, over the whole vocabulary, as vLLM's."""

    def __init__(self, ids: list[int], vocab_size: int) -> None:
        self.mask = np.zeros(vocab_size, dtype=bool)
        self.mask[ids] = True

    def allowed(self, vocab_size: int) -> np.ndarray:
        return np.ones(vocab_size, dtype=bool)

    def adjust(self, x: np.ndarray) -> np.ndarray:
        return np.where(self.mask, x, np.float32(-np.inf)).astype(x.dtype)

    def accept(self, token: int) -> None:
        if not self.mask[token]:
            raise ValueError(f"token {token} is not among the request's allowed_token_ids")


class Chain:
    """Several constraints on one sequence: every mask must allow a token; adjustments in order."""

    def __init__(self, *parts: TokenConstraint) -> None:
        self.parts = parts

    def allowed(self, vocab_size: int) -> np.ndarray:
        mask = np.ones(vocab_size, dtype=bool)
        for part in self.parts:
            mask &= part.allowed(vocab_size)
        return mask

    def adjust(self, x: np.ndarray) -> np.ndarray:
        for part in self.parts:
            x = adjusted(part, x)
        return x

    def accept(self, token: int) -> None:
        for part in self.parts:
            part.accept(token)


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """A bool mask over the vocabulary as int32 words, xgrammar's layout: id j is bit j % 32 of word j // 32."""
    padded = np.zeros(-(-mask.size // 32) * 32, dtype=bool)
    padded[: mask.size] = mask
    return np.packbits(padded.reshape(-1, 32), axis=1, bitorder="little").view(np.int32).reshape(-1)


def unpack_mask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(np.asarray(words, dtype=np.int32).view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def fill_bitmasks(constraints: list[TokenConstraint | None], vocab_size: int) -> None:
    """Fills ahead, together, the bitmasks of the grammars that can fill several at once (their type's
    `fill_together`: xgrammar's batch fill on several threads); each one's `bitmask` then returns its row."""
    groups: dict = {}
    for constraint in constraints:
        for part in (constraint.parts if isinstance(constraint, Chain) else (constraint,)):
            together = getattr(type(part), "fill_together", None)
            if together is not None:
                groups.setdefault(together, []).append(part)
    for together, parts in groups.items():
        if len(parts) > 1:
            together(parts, vocab_size)


def bitmask_of(constraint: TokenConstraint, vocab_size: int) -> np.ndarray | None:
    """The next token's allowed ids as int32 words where the constraint knows them before the logits (a grammar:
    the sampler tail then draws the row under them on the device); None where every id is allowed."""
    if isinstance(constraint, Chain):
        words = [w for w in (bitmask_of(part, vocab_size) for part in constraint.parts) if w is not None]
        return np.bitwise_and.reduce(words) if words else None
    bitmask = getattr(constraint, "bitmask", None)
    return None if bitmask is None else bitmask(vocab_size)


def adjusts(constraint: TokenConstraint) -> bool:
    """Whether the constraint changes the logits (penalties), so that its row is drawn on the host."""
    if isinstance(constraint, Chain):
        return any(adjusts(part) for part in constraint.parts)
    return getattr(constraint, "adjust", None) is not None


def penalty_state(constraint: TokenConstraint | None) -> "PenaltyState | None":
    """The constraint's penalties (the sampler tail can apply them: PenaltyState.terms), if it has any."""
    if isinstance(constraint, Chain):
        return next((state for state in map(penalty_state, constraint.parts) if state is not None), None)
    return constraint if isinstance(constraint, PenaltyState) else None


def drawn_in_tail(constraint: TokenConstraint, top_logprobs: bool, penalties: bool) -> bool:
    """Whether the sampler tail draws every row of the constraint, so that no draw needs its logits on the host:
    each part a grammar with a bitmask, or penalties where the tail takes them (`penalties`: the engine's does)
    and no top logprobs are asked (device_sampling.finish)."""
    parts = constraint.parts if isinstance(constraint, Chain) else (constraint,)
    return all((isinstance(part, PenaltyState) and penalties and not top_logprobs) or
               (getattr(part, "bitmask", None) is not None and getattr(part, "adjust", None) is None)
               for part in parts)


def has_grammar(constraint: TokenConstraint) -> bool:
    """Whether the constraint limits the ids a token may be (a grammar's bitmask), not only the logits."""
    if isinstance(constraint, Chain):
        return any(has_grammar(part) for part in constraint.parts)
    return getattr(constraint, "bitmask", None) is not None or getattr(constraint, "adjust", None) is None


def adjusted(constraint: TokenConstraint, x: np.ndarray) -> np.ndarray:
    adjust = getattr(constraint, "adjust", None)
    return x if adjust is None else adjust(x)


def draw_masked(row: np.ndarray, sampling: tuple) -> int:
    """sample_row of a row whose disallowed ids are -inf. A row that samples the whole vocabulary (nothing cut) is
    the argmax of logits / T + noise over its allowed ids alone, with each id's own noise: the same token, without
    drawing noise for ids that cannot win (the bulk of a 150k vocabulary under most grammar states)."""
    temperature, top_k, top_p, min_p, seed, step = sampling
    allowed = np.flatnonzero(np.isfinite(row))
    whole = temperature >= GREEDY_BELOW and effective_top_k(top_k, row.size) == row.size and top_p >= 1 \
        and min_p <= 0
    if not whole:
        return sample_row(row, *sampling)
    scores = row[allowed] / np.float32(temperature) + gumbel(int(seed) % 2 ** 64, step, allowed)
    return int(allowed[np.argmax(scores)])


def draw_constrained(x: np.ndarray, constraint: TokenConstraint, sampling: tuple,
                     allowed: np.ndarray | None = None) -> tuple[int, float]:
    """(token, logprob) of a row of float32 logits under its constraint; `sampling`: the row's (temperature, top_k,
    top_p, min_p, seed, step), as the sample op takes them; `allowed`: its mask where already asked for. The
    logprob is over the ids the mask allows, before penalties (vLLM's raw logprobs under a grammar). A constraint
    that fails (raises, or allows no id) draws the row unconstrained: one request's grammar must not stop the
    engine, which serves every other."""
    try:
        mask = np.asarray(constraint.allowed(x.size) if allowed is None else allowed, dtype=bool)
        row = adjusted(constraint, x)
    except Exception as error:  # noqa: BLE001  whatever the grammar library raised
        LOG.warning("a token constraint failed (%s): the row is drawn unconstrained", error)
        mask, row = np.ones(x.shape, dtype=bool), x
    if mask.shape != x.shape:
        mask = np.ones(x.shape, dtype=bool)
    masked = np.where(mask, row, -np.inf).astype(np.float32)
    if not np.isfinite(masked).any():  # penalties masked all the grammar allows: the grammar alone
        masked = np.where(mask, x, -np.inf).astype(np.float32)
    if not np.isfinite(masked).any():
        masked = x
    token = draw_masked(masked, sampling)
    accept(constraint, token)
    scored = np.where(mask, x, -np.inf).astype(np.float32) if mask[token] else x
    return token, float(scored[token] - logsumexp_row(scored))


def accept(constraint: TokenConstraint, token: int) -> None:
    try:
        constraint.accept(token)
    except Exception as error:  # noqa: BLE001  as draw_constrained: the request goes on unconstrained
        LOG.warning("a token constraint refused its draw (%s)", error)
