"""A request's constraint on the tokens it may draw (a grammar, for structured outputs and tool calls): before each
draw, the mask of allowed ids over the model's vocabulary; after it, the token drawn. A constrained row is drawn on
the host from its full logits row with the others masked to -inf, by the `sample` op's rule and noise; its logprob is
the unmasked one (as vLLM reports raw logprobs)."""

from typing import Protocol

import numpy as np

from pegainfer.ir.ops.sampling import logsumexp_row, sample_row


class TokenConstraint(Protocol):
    def allowed(self, vocab_size: int) -> np.ndarray:
        """A bool mask of the ids the next token may be (at least one true)."""

    def accept(self, token: int) -> None:
        """The token drawn; raises where the constraint did not allow it."""


def draw_constrained(x: np.ndarray, constraint: TokenConstraint, sampling: tuple) -> tuple[int, float]:
    """(token, logprob) of a row of float32 logits under its constraint; `sampling`: the row's (temperature, top_k,
    top_p, min_p, seed, step), as the sample op takes them."""
    mask = constraint.allowed(x.size)
    if mask.shape != x.shape or not mask.any():
        raise RuntimeError(f"a token constraint allowed no id of the {x.size}-id vocabulary "
                           f"(mask of shape {mask.shape}, {int(mask.sum())} allowed)")
    token = sample_row(np.where(mask, x, -np.inf).astype(np.float32), *sampling)
    constraint.accept(token)
    return token, float(x[token] - logsumexp_row(x))
