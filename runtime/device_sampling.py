"""Sampling inside the step, from the host's side: the per-row sampling inputs a step carries, and the result
its sampler outputs make (a token per row, and logprobs when asked). The device draws each row by the `sample`
op (ir/ops/sampling.py); a row it could not settle, because its kept set reaches past the top-k candidates, is
drawn here from its full logits row with the same noise, so the token is the one the op defines either way."""

import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pegainfer.ir.ops.sampling import UNRESOLVED, logsumexp_row, mask_tokens, sample_row
from pegainfer.ir.registry import get_op
from pegainfer.ir.step import (PENALTY_COUNT, PENALTY_IDS, PENALTY_START, PENALTY_TERMS, SAMPLER_OUTPUTS,
                               SAMPLING_INPUTS, TOKEN_BITMASK, TOKEN_MASK_INDEX, TOP_LOGPROBS)
from pegainfer.runtime.constraint import (TokenConstraint, accept, adjusts, bitmask_of, draw_constrained,
                                          fill_bitmasks, has_grammar, penalty_state, unpack_mask)
from pegainfer.runtime.sampler import SamplingParams

_INT32_MAX = 2 ** 31 - 1
LOG = logging.getLogger("pegainfer")


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # per row: the top-K tokens' logprobs, then the chosen one's (if not in)
    host_rows: list[int] = field(default_factory=list)  # rows drawn on the host from their full logits
    features: np.ndarray | None = None  # a row for every token of the step, where a drafter reads them
    stale: list[int] = field(default_factory=list)  # rows left undrawn: their logits were gone (finish)


def greedy_inputs(rows: int) -> dict[str, np.ndarray]:
    """Sampling inputs for a step that only wants logits: greedy rows, no top logprobs."""
    inputs = {name: np.zeros(rows, dtype=t.dtype.np_dtype) for name, t in SAMPLING_INPUTS.items()}
    inputs["sampling_top_p"][:] = 1.0
    return inputs | {TOP_LOGPROBS: np.zeros(rows, np.int32)}


def no_penalties(rows: int) -> dict[str, np.ndarray]:
    """The penalty inputs of rows without penalties (ir/step.py): no entries, one unread entry to give the buffers
    a size."""
    return {PENALTY_START: np.zeros(rows, np.int32), PENALTY_COUNT: np.zeros(rows, np.int32),
            PENALTY_IDS: np.zeros(1, np.int32), PENALTY_TERMS: np.zeros((1, 3), np.float32)}


def sampling_inputs(params: list[SamplingParams], token_index: list[int],
                    rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One row per request: its parameters, its seed (a fresh random one when it has none) and the index of the
    token being drawn, which together pick the row's noise."""
    if len(params) != len(token_index):
        raise ValueError(f"{len(params)} sampling params for {len(token_index)} token indices")
    if any(not 0 <= i <= _INT32_MAX for i in token_index):
        raise ValueError(f"token indices must be in [0, {_INT32_MAX}], found {token_index}")
    seeds = [p.seed if p.seed is not None else int(rng.integers(0, 2 ** 63)) for p in params]
    return {
        "sampling_temperature": np.array([p.temperature for p in params], dtype=np.float32),
        "sampling_top_k": np.array([min(max(p.top_k, 0), _INT32_MAX) for p in params], dtype=np.int32),
        "sampling_top_p": np.array([p.top_p for p in params], dtype=np.float32),
        "sampling_min_p": np.array([p.min_p for p in params], dtype=np.float32),
        "sampling_seed": np.array([s % 2 ** 64 for s in seeds], dtype=np.uint64).view(np.int64),
        "sampling_step": np.array(token_index, dtype=np.int32),
        TOP_LOGPROBS: np.array([p.logprobs or 0 for p in params], dtype=np.int32),
    }


def penalty_inputs(constraints: list[TokenConstraint | None] | None, params: list[SamplingParams], rows: int,
                   capacity: int) -> tuple[dict[str, np.ndarray], set[int]]:
    """The step inputs of the rows' penalties (ir/step.py), drawn under them in the sampler tail, and which rows
    they are: those with penalties that ask no top logprobs (the tail's candidates are of the penalised logits,
    vLLM's top logprobs of the raw ones), while their entries fit in `capacity`; the others are drawn on the host."""
    inputs, rows_on_device = no_penalties(rows), set()
    ids, terms, entries = [], [], 0
    for row, constraint in enumerate(constraints or []):
        state = penalty_state(constraint)
        if state is None or params[row].logprobs:
            continue
        row_ids, row_terms = state.terms()
        if entries + row_ids.size > capacity:
            continue
        inputs[PENALTY_START][row], inputs[PENALTY_COUNT][row] = entries, row_ids.size
        ids.append(row_ids)
        terms.append(row_terms)
        entries += row_ids.size
        rows_on_device.add(row)
    if entries:
        inputs[PENALTY_IDS], inputs[PENALTY_TERMS] = np.concatenate(ids), np.concatenate(terms)
    return inputs, rows_on_device


def device_masks(constraints: list[TokenConstraint | None] | None, vocab_size: int) -> dict[int, np.ndarray]:
    """Row -> the grammar bitmask its constraint gives before the step (drawn under it in the sampler tail); rows
    whose grammar fails or allows nothing are left to the host's draw, which copes with both."""
    masks = {}
    try:
        fill_bitmasks([c for c in constraints or [] if c is not None], vocab_size)
    except Exception as error:  # noqa: BLE001  whatever the grammar library raised: each row fills its own below
        LOG.warning("filling the grammar masks together failed (%s): each is filled alone", error)
    for row, constraint in enumerate(constraints or []):
        if constraint is None:
            continue
        try:
            words = bitmask_of(constraint, vocab_size)
        except Exception as error:  # noqa: BLE001  whatever the grammar library raised
            LOG.warning("a token constraint failed (%s): the row is drawn on the host", error)
            continue
        if words is not None and words.any():
            masks[row] = words
    return masks


def mask_inputs(rows: int, masks: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """The step inputs of the tail's grammar masks (ir/step.py) where a row has one: the masked rows' bitmasks
    stacked and each row's index into them, -1 for a row without (pack_step's defaults stand for none)."""
    if not masks:
        return {}
    bitmask, index = stack_masks(masks, rows, next(iter(masks.values())).size)
    return {TOKEN_BITMASK: bitmask, TOKEN_MASK_INDEX: index}


def stack_masks(masks: dict[int, np.ndarray], rows: int, words: int) -> tuple[np.ndarray, np.ndarray]:
    bitmask = np.zeros((max(len(masks), 1), words), dtype=np.int32)
    index = np.full(rows, -1, dtype=np.int32)
    for position, (row, row_words) in enumerate(sorted(masks.items())):
        bitmask[position], index[row] = row_words, position
    return bitmask, index


def masked_logits(logits: np.ndarray, masks: dict[int, np.ndarray]) -> np.ndarray:
    """The rows' logits with what their grammar bitmasks leave out at -inf (mask_tokens), for a tail on the host."""
    if not masks:
        return logits
    return mask_tokens(logits, *stack_masks(masks, logits.shape[0], next(iter(masks.values())).size))


def tail_reference(logits: np.ndarray, inputs: dict[str, np.ndarray], candidates: int) -> dict[str, np.ndarray]:
    """The sampler tail's outputs computed on the host from float32 logits, by the ops' references: what a graph
    without the tail (a model's declared graph) lacks."""
    k = min(candidates, logits.shape[1])
    values, ids = get_op("top_k").reference(logits, inputs[TOP_LOGPROBS], k=k)
    lse = get_op("logsumexp").reference(logits)
    tokens, logprobs = get_op("sample").reference(logits, *(inputs[name] for name in SAMPLING_INPUTS),
                                                  candidates=k)
    return dict(zip(SAMPLER_OUTPUTS, (values, ids, lse, tokens, logprobs)))


def wants_top_logprobs(params: list[SamplingParams]) -> bool:
    return any(p.logprobs for p in params)


def finish(outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray], params: list[SamplingParams],
           row_logits: Callable[[int], np.ndarray], constraints: list[TokenConstraint | None] | None = None,
           masks: dict[int, np.ndarray] | None = None, penalized: set[int] | None = None,
           logits_gone: bool = False) -> SampleResult:
    """The tokens and logprobs of a step's rows from its sampler outputs (`top_values`, `top_ids`, `logsumexp`
    may be left out when no row asks for top logprobs). `masks`: the rows the tail drew under a grammar bitmask
    (device_masks); `penalized`: those it drew under their penalties (penalty_inputs). `row_logits(r)`: row r's
    float32 logits, fetched only for rows the device left unresolved and for constrained rows it could not take
    (drawn on the host: runtime/constraint.py). `logits_gone`: a later step has overwritten the logits, so such a
    row is left undrawn: `stale`, its token UNRESOLVED, its constraint not told."""
    result, masks, penalized = SampleResult([], []), masks or {}, penalized or set()
    for r, p in enumerate(params):
        token, logprob = int(outputs["sampled_ids"][r]), float(outputs["sampled_logprobs"][r])
        constraint = constraints[r] if constraints else None
        sampling = tuple(inputs[name][r].item() for name in SAMPLING_INPUTS)
        on_device = constraint is None or ((r in masks or not has_grammar(constraint))
                                           and (r in penalized or not adjusts(constraint)))
        if logits_gone and (token == UNRESOLVED or not on_device):
            result.stale.append(r)
            result.tokens.append(UNRESOLVED)
            result.logprobs.append(None)
            continue
        if constraint is not None and (not on_device or token == UNRESOLVED):
            x = np.asarray(row_logits(r), dtype=np.float32)
            allowed = unpack_mask(masks[r], x.size) if r in masks else None
            token, logprob = draw_constrained(x, constraint, sampling, allowed)
            result.host_rows.append(r)
        elif token == UNRESOLVED:
            x = np.asarray(row_logits(r), dtype=np.float32)
            token = sample_row(x, *sampling)
            logprob = float(x[token] - logsumexp_row(x))
            result.host_rows.append(r)
        elif constraint is not None:
            accept(constraint, token)
        result.tokens.append(token)
        if p.logprobs is None:
            result.logprobs.append(None)
            continue
        top = {int(outputs["top_ids"][r, j]): float(outputs["top_values"][r, j] - outputs["logsumexp"][r])
               for j in range(min(p.logprobs, outputs["top_ids"].shape[1]))} if p.logprobs else {}
        result.logprobs.append(top | {token: top.get(token, logprob)})
    return result
