"""Sampling parameters, and sampling on the CPU with NumPy's generator: greedy, temperature, min-p, top-k, top-p,
a per-request seed, and top-K logprobs. Engines draw on the device instead (runtime/device_sampling.py)."""

from dataclasses import dataclass

import numpy as np

from pegainfer.errors import RequestError
from pegainfer.ir.ops.sampling import GREEDY_BELOW, TOP_P_SLACK  # noqa: F401  (one definition, re-exported)

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # under GREEDY_BELOW (0, say) is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) keeps every token
    seed: int | None = None
    logprobs: int | None = None  # how many top tokens to report per generated token
    max_tokens: int = 16
    ignore_eos: bool = False
    min_p: float = 0.0  # keeps tokens at least this fraction as likely as the most likely one (after temperature)

    def validate(self) -> None:
        """Raises RequestError naming the parameter, the allowed range and what was given."""
        checks = [
            ("temperature", self.temperature >= 0 and np.isfinite(self.temperature), ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1, 0 (all tokens) or a positive count"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
            ("seed", self.seed is None or self.seed >= 0, "a non-negative integer"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise RequestError(f"{name} must be {allowed}, got {getattr(self, name)!r}")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from one row of float32 logits."""
    if params.temperature < GREEDY_BELOW:
        return int(np.argmax(logits))
    probs = np.exp(log_softmax(logits.astype(np.float64) / params.temperature))
    if params.min_p > 0:
        probs = np.where(probs >= params.min_p * probs.max(), probs, 0.0)
    if 0 < params.top_k < probs.size:
        cutoff = np.partition(probs, -params.top_k)[-params.top_k]
        probs = np.where(probs >= cutoff, probs, 0.0)
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]  # mass of the tokens ranked above each one
        probs[order[before >= (params.top_p - TOP_P_SLACK) * probs.sum()]] = 0.0
    probs = probs / probs.sum()
    return int(rng.choice(probs.size, p=probs))


def top_logprobs(logits: np.ndarray, count: int, chosen: int) -> dict[int, float]:
    """The `count` most likely tokens' logprobs (of the unscaled distribution), plus the chosen token's."""
    logprobs = log_softmax(logits.astype(np.float64))
    top = np.argsort(-logprobs, kind="stable")[:count]
    return {int(t): float(logprobs[t]) for t in [*top, chosen]}
