"""The reference of vLLM's sampling penalties on a row of logits, applied before temperature and the cuts, in vLLM's
order: logit_bias added and min_tokens masking the stop tokens until that many tokens are out; then the repetition
penalty over the prompt's and the output's tokens (Hugging Face's RepetitionPenaltyLogitsProcessor: a positive logit
divided by it, a negative one multiplied), the presence and frequency penalties over the output's tokens (subtracted
once, and once per occurrence); a bad word's last token masked where the output so far ends with the rest of it
(vLLM's bad_words). The GPU tail applies the same as sparse per-id terms (ir/ops/sampling.py's penalize_tokens,
runtime/constraint.py's PenaltyState.terms); the CPU engine draws a penalised row on the host."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids inside the vocabulary
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences, each non-empty

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias or self.min_tokens
                    or self.bad_words)


def penalize(x: np.ndarray, penalties: Penalties, seen: np.ndarray, counts: np.ndarray, produced: int,
             stop_ids: list[int], output: tuple[int, ...] = ()) -> np.ndarray:
    """The row's logits after the penalties: `seen` marks the prompt's and output's ids, `counts` the output's
    occurrences of each id, `produced` the output's length so far, `stop_ids` what min_tokens holds back, `output`
    the output's tokens (for bad words)."""
    x = np.asarray(x, dtype=np.float32).copy()
    if penalties.logit_bias:
        ids, biases = zip(*penalties.logit_bias)
        x[list(ids)] += np.asarray(biases, dtype=np.float32)
    if penalties.repetition != 1.0:
        r = np.float32(penalties.repetition)
        x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    if penalties.presence or penalties.frequency:
        x -= np.float32(penalties.presence) * (counts > 0) + np.float32(penalties.frequency) * counts
    x[masked_ids(penalties, produced, stop_ids, output, x.size)] = -np.inf  # -inf stays so whatever came before
    return x


def masked_ids(penalties: Penalties, produced: int, stop_ids: list[int], output: tuple[int, ...] | list[int],
               size: int) -> list[int]:
    """The ids the next draw may not take: the stop ids while min_tokens holds them back, and each bad word's last
    token where the output so far ends with the rest of it."""
    masked = [t for t in stop_ids if t < size] if produced < penalties.min_tokens else []
    for word in penalties.bad_words:
        head = word[:-1]
        if word[-1] < size and (not head or tuple(output[-len(head):]) == head):
            masked.append(word[-1])
    return masked
