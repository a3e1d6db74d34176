"""What a request asks of the sampler: temperature, min-p, top-k, top-p, a seed, top-K logprobs and when to stop.
Tokens are drawn inside the engine's step by the `sample` op (ir/ops/sampling.py, runtime/device_sampling.py)."""

from dataclasses import dataclass

import numpy as np

from pegainfer.errors import RequestError

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # under ir.ops.sampling.GREEDY_BELOW (0, say) is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) keeps every token
    seed: int | None = None
    logprobs: int | None = None  # how many top tokens to report per generated token
    max_tokens: int = 16
    ignore_eos: bool = False
    min_p: float = 0.0  # keeps tokens at least this fraction as likely as the most likely one (after temperature)
    prompt_logprobs: int | None = None  # top tokens to report per prompt position (runtime/prompt_logprobs.py)
    min_tokens: int = 0  # tokens before EOS may come (ir/ops/penalties.py) and stop strings are looked for

    def validate(self) -> None:
        """Raises RequestError naming the parameter, the allowed range and what was given."""
        checks = [
            ("temperature", self.temperature >= 0 and np.isfinite(self.temperature), ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1, 0 (all tokens) or a positive count"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"in [0, {MAX_LOGPROBS}]"),
            ("seed", self.seed is None or self.seed >= 0, "a non-negative integer"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise RequestError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
