"""Prompt logprobs (echo with logprobs, vLLM's prompt_logprobs): a request that asks for them has its prompt chunks
run apart, with every position's logits, and never from the prefix cache (a cached block has no logits); each
prompt token gets its logprob under the positions before it and the top-k of that position. The chunk that ends the
prompt also draws the first token, on the host from its last row by the `sample` op's rule (the same token the
engine's tail would draw: the host path of runtime/device_sampling.py)."""

import numpy as np

from pegainfer.ir.ops.sampling import logsumexp_row, ranked_prefix
from pegainfer.passes.fusion import TAIL_TOP_K
from pegainfer.runtime.constraint import TokenConstraint
from pegainfer.runtime.device_sampling import finish, sampling_inputs, tail_reference
from pegainfer.runtime.sampler import SamplingParams


def position_logprobs(rows: np.ndarray, token_ids: list[int], start: int, prompt_len: int,
                      top: int) -> list[dict[int, float]]:
    """For each row r (position start + r) whose next token is still in the prompt: {top ids: logprob} and that
    next token's own."""
    steps = []
    for r, x in enumerate(np.asarray(rows, dtype=np.float32)):
        position = start + r + 1
        if position >= prompt_len:
            break
        logprobs = x - logsumexp_row(x)
        best = ranked_prefix(logprobs, min(top, logprobs.size)) if top else []
        token = token_ids[position]
        steps.append({int(t): float(logprobs[t]) for t in best} | {token: float(logprobs[token])})
    return steps


def draw_first(x: np.ndarray, params: SamplingParams, token_index: int, constraint: TokenConstraint | None,
               rng: np.random.Generator) -> tuple[int, dict[int, float] | None]:
    """The first generated token from the prompt's last row, and its logprobs entry when the request asks."""
    sampling = sampling_inputs([params], [token_index], rng)
    row = np.asarray(x, dtype=np.float32)[None]
    result = finish(tail_reference(row, sampling, TAIL_TOP_K), sampling, [params], lambda r: row[r],
                    [constraint] if constraint is not None else None)
    return result.tokens[0], result.logprobs[0]
