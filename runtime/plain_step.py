"""A plain step of the scheduler (runtime/scheduler.py): launch, wait, read the tokens into their sequences. Every
step runs so but those async scheduling overlaps (runtime/overlap.py): prompt chunks scored for their logprobs,
speculative steps, rows the host draws from their logits, a step that would preempt."""

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from pegainfer.runtime.batch import Chunk
from pegainfer.runtime.block_records import record_blocks
from pegainfer.runtime.device_sampling import SampleResult
from pegainfer.runtime.prompt_logprobs import draw_first, position_logprobs
from pegainfer.runtime.requests import TokenOutput
from pegainfer.runtime.step_stats import StepRecord

if TYPE_CHECKING:
    from pegainfer.runtime.scheduler import Scheduler


def run_plain_step(sched: "Scheduler", chunks: list[Chunk], launched: Callable[[], None] | None = None
                   ) -> list[TokenOutput]:
    """Runs the scheduled chunks and reads their tokens before returning. `launched` is called once the engine has
    queued the step, before it waits for it (the engine loop's hand-over)."""
    if not chunks:
        return []
    began = time.monotonic()
    scoring = [sched.state_of(c).scoring for c in chunks]
    scored_tokens = sum(c.num_tokens for c, s in zip(chunks, scoring) if s)
    scored = [out for c, s in zip(chunks, scoring) if s if (out := score(sched, c)) is not None]
    chunks = [c for c, s in zip(chunks, scoring) if not s]
    if not chunks:  # the trace's line counts the scoring chunks' engine calls and the tokens they gave
        sched.last_step = StepRecord(began, time.monotonic() - began, len(scoring), scored_tokens, scored_tokens,
                                     len(scored))
        return scored
    states = [sched.state_of(c) for c in chunks]
    prefill = sum(c.num_tokens for c, st in zip(chunks, states)  # decode and verifying chunks are not prefill
                  if not (c.num_tokens == c.draws and st.num_generated))
    sched.stats.prefill_tokens += prefill
    start = time.monotonic()
    # a constraint sees only draws that become tokens: not those of prompt chunks short of the prompt's end
    # (a speculating sequence has none); a verifying chunk draws at each of its tokens
    constraints = [st.request.constraint if c.seq.num_cached + c.num_tokens >= len(c.seq.token_ids) else None
                   for c, st in zip(chunks, states) for _ in range(c.draws)]
    params = [st.request.params for c, st in zip(chunks, states) for _ in range(c.draws)]
    token_index = [st.num_generated + j for c, st in zip(chunks, states) for j in range(c.draws)]
    result = sched.engine.sample(chunks, params, token_index,
                                 constraints if any(c is not None for c in constraints) else None, launched)
    seconds = time.monotonic() - start
    tokens = sum(c.num_tokens for c in chunks)
    sched.stats.steps += 1
    sched.stats.step_tokens[tokens] += 1
    outputs = process(sched, chunks, result)
    sched.last_step = StepRecord(began, start + seconds - began, len(scoring), tokens + scored_tokens,
                                 prefill + scored_tokens, len(scored) + len(outputs))
    return scored + outputs


def score(sched: "Scheduler", chunk: Chunk) -> TokenOutput | None:
    """A prompt chunk of a request that wants prompt logprobs, run alone with every position's logits; the
    first token when it ends the prompt."""
    state, start = sched.state_of(chunk), chunk.seq.num_cached
    rows = sched.engine.step([chunk], all_logits=True)
    prompt = state.request.prompt_ids
    state.prompt_steps = (state.prompt_steps or [])[:start] + position_logprobs(  # a recompute rewrites
        rows, prompt, start, len(prompt), state.request.params.prompt_logprobs)
    sched.stats.prefill_tokens += chunk.num_tokens
    record_blocks(state, sched.cache, sched.snapshots, sched.engine)
    if chunk.seq.num_cached < len(chunk.seq.token_ids):
        return None
    token, logprobs = draw_first(rows[chunk.num_tokens - 1], state.request.params, 0, state.request.constraint,
                                 sched.rng)
    return replace(sched.append(state, token, logprobs, time.monotonic()), prompt_logprobs=state.prompt_steps)


def process(sched: "Scheduler", chunks: list[Chunk], result: SampleResult) -> list[TokenOutput]:
    """The step's draws into their sequences (a verified chunk's kept drafts, then its next token), the blocks they
    filled into the prefix cache; a request ends at its first finishing token."""
    outputs, now, row, first_token = [], time.monotonic(), 0, 0
    for chunk in chunks:
        state = sched.state_of(chunk)
        tokens, logprobs = result.tokens[row:row + chunk.draws], result.logprobs[row:row + chunk.draws]
        row += chunk.draws
        start = state.seq.num_cached - chunk.num_tokens  # the chunk's first position
        verified = bool(state.drafts)
        if verified:
            kept = sched.spec.settle(state, tokens)
            tokens, logprobs = tokens[:kept], logprobs[:kept]
        if result.features is not None and sched.spec is not None:  # a drafter reads the kept positions
            rows = result.features[first_token:first_token + state.seq.num_cached - start]
            sched.spec.observe(state.seq.seq_id, start, rows)
        first_token += chunk.num_tokens
        record_blocks(state, sched.cache, sched.snapshots, sched.engine)
        if state.seq.num_cached < len(state.seq.token_ids) and not verified:
            continue  # a prompt chunk short of the prompt's end: its draw is not a next token
        for token, token_logprobs in zip(tokens, logprobs):
            outputs.append(sched.append(state, token, token_logprobs, now))
            if outputs[-1].finish_reason is not None:
                break
    return outputs
