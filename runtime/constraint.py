"""A request's constraint on the tokens it may draw (a grammar, for structured outputs and tool calls): before each
draw, the mask of allowed ids over the model's vocabulary; after it, the token drawn. A constrained row is drawn on
the host from its full logits row with the others masked to -inf, by the `sample` op's rule and noise; its logprob is
the unmasked one (as vLLM reports raw logprobs)."""

import logging
from typing import Protocol

import numpy as np

from pegainfer.ir.ops.sampling import logsumexp_row, sample_row

LOG = logging.getLogger("pegainfer")


class TokenConstraint(Protocol):
    def allowed(self, vocab_size: int) -> np.ndarray:
        """A bool mask of the ids the next token may be (at least one true)."""

    def accept(self, token: int) -> None:
        """The token drawn; raises where the constraint did not allow it."""


def draw_constrained(x: np.ndarray, constraint: TokenConstraint, sampling: tuple) -> tuple[int, float]:
    """(token, logprob) of a row of float32 logits under its constraint; `sampling`: the row's (temperature, top_k,
    top_p, min_p, seed, step), as the sample op takes them. A constraint that fails (raises, or allows no id) draws
    the row unconstrained: one request's grammar must not stop the engine, which serves every other."""
    try:
        mask = np.asarray(constraint.allowed(x.size), dtype=bool)
    except Exception as error:  # noqa: BLE001  whatever the grammar library raised
        LOG.warning("a token constraint failed (%s): the row is drawn unconstrained", error)
        mask = np.ones(x.shape, dtype=bool)
    if mask.shape != x.shape or not mask.any():
        mask = np.ones(x.shape, dtype=bool)
    token = sample_row(np.where(mask, x, -np.inf).astype(np.float32), *sampling)
    try:
        constraint.accept(token)
    except Exception as error:  # noqa: BLE001  as above: the request goes on unconstrained
        LOG.warning("a token constraint refused its draw (%s)", error)
    return token, float(x[token] - logsumexp_row(x))
