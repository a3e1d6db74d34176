"""Async scheduling: the scheduler launches step N+1 before it reads step N's tokens, so that its host work
(scheduling, packing, reading and streaming the tokens of N) runs while the GPU runs N, as vLLM's and SGLang's
overlapped schedulers do. A draw not read yet is a PENDING token of its sequence (runtime/pending_tokens.py), which
the next step's engine copies into its input on the device.

A request takes part only where the device draws all its rows: no prompt logprobs, and a constraint, if any, the
sampler tail takes (grammars with bitmasks, penalties without top logprobs: constraint.drawn_in_tail). The masks
and penalties of a step holding such a row depend on the token drawn just before, so that step's layers are
launched first and the step in flight is read between them and its sampler tail (the engine's `before_masks`),
while the GPU runs the layers; a row whose request that read ended or rolled back draws without its constraint.
Models with recurrent layers take part too: a state snapshot is copied as the step ending on its block boundary is
launched (runtime/block_records.py); so does a host KV tier, whose copies follow the steps queued before them.
Speculation, and a step that would preempt, run the plain steps of runtime/scheduler.py.

A sequence that stops on a token learnt one step late has one wasted row in the step after; its blocks are freed
while that step runs, and reused only by steps queued after it on the same stream. A draw whose logits the host
needs (one the device left unresolved: a top-p, min-p or wide top-k cut reaching past the tail's candidates, logits
not finite; a grammar that failed or allows nothing; penalties past the tail's capacity) read after a later step
has overwritten them is rolled back: its last token runs again in a plain step, where the host reads its logits,
and its request takes plain steps from then on (a recurrent sequence, whose state has run the rows after the draw,
is preempted and recomputed). A step's trace line (StepRecord) spans the call that reads it: the next step's
scheduling and launch, then the wait and the read."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pegainfer.runtime.batch import Chunk
from pegainfer.runtime.block_records import record_blocks, snapshot_at_launch
from pegainfer.runtime.constraint import drawn_in_tail
from pegainfer.runtime.device_sampling import SampleResult
from pegainfer.runtime.pending_tokens import PENDING
from pegainfer.runtime.request_state import RequestState
from pegainfer.runtime.requests import EngineRequest, TokenOutput
from pegainfer.runtime.step_stats import StepRecord

if TYPE_CHECKING:
    from pegainfer.runtime.scheduler import Scheduler


def overlappable(request: EngineRequest, penalties_in_tail: bool) -> bool:
    """Whether the device draws all the request's rows (see the module's docstring); `penalties_in_tail`: the
    engine's sampler tail applies penalties (the GPU's; the reference engine's on a lowered graph)."""
    constraint, params = request.constraint, request.params
    return params.prompt_logprobs is None and \
        (constraint is None or drawn_in_tail(constraint, bool(params.logprobs), penalties_in_tail))


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read: its chunks and their states, which of them drew a
    token, and what the step record counts."""
    chunks: list[Chunk]
    states: list[RequestState]
    result: Callable[[], SampleResult]
    drew: list[bool]
    tokens: int
    prefill: int


class Overlap:
    def __init__(self, scheduler: "Scheduler") -> None:
        self.scheduler = scheduler
        self.in_flight: InFlight | None = None
        self.plain_next = False  # after a roll-back: the next step is a plain one
        self.rolling_back: list[tuple[RequestState, int, int]] = []  # found by a read, undone once no launch is open

    def step(self, launched: Callable[[], None] | None) -> list[TokenOutput]:
        """Launches the next step where it may go ahead, then reads the step before it; the tokens returned are
        that one's (none where this call only launched)."""
        s = self.scheduler
        if self.in_flight is None:
            if self.plain_next or not all(st.overlappable for st in s.running):
                self.plain_next = False
                return s.run_step(s.schedule(), launched)
            chunks = s.schedule()
            if chunks and not all(s.state_of(c).overlappable for c in chunks):  # an admission that cannot overlap
                return s.run_step(chunks, launched)
            if chunks:
                self.in_flight, _ = self._launch(chunks)
                if launched is not None:
                    launched()
            return []
        began = time.monotonic()
        head = s.waiting.peek() if s.waiting and len(s.running) < s.config.max_num_seqs else None
        chunks = None if self.plain_next or (head is not None and not head.overlappable) \
            else s.schedule(ahead=True)  # a request that cannot overlap and may be admitted: a plain step next
        newer, outputs = self._launch(chunks, self.in_flight, began) if chunks else (None, None)
        if newer is not None and launched is not None:
            launched()
        if outputs is None:  # not read inside the launch: no constrained row in it
            outputs = self._read(self.in_flight, began)
        for state, index, generated in self.rolling_back:
            self._roll_back(state, index, generated)
        self.rolling_back.clear()
        self.in_flight = newer
        return outputs

    def _launch(self, chunks: list[Chunk], flight: InFlight | None = None, began: float = 0.0
                ) -> tuple[InFlight, list[TokenOutput] | None]:
        """Queues the step; each chunk that reaches its sequence's end draws a PENDING token, and one whose draw
        ends it by length is scheduled no more. With constrained rows, `flight` is read between the step's layers
        and its tail (the outputs returned; else None)."""
        s = self.scheduler
        states = [s.state_of(c) for c in chunks]
        drew = [c.seq.num_cached + c.num_tokens == len(c.seq.token_ids) for c in chunks]  # short prompt chunks: none
        constraints = [st.request.constraint if d else None for st, d in zip(states, drew)]
        read: list[list[TokenOutput]] = []
        undone: set[int] = set()  # the states that read rolls back (ids)

        def before_masks() -> list[int]:
            """The step in flight read: its draws move the grammars and penalties this step's masks come from."""
            read.append(self._read(flight, began))
            undone.update(id(state) for state, _, _ in self.rolling_back)
            return [row for row, (c, st) in enumerate(zip(chunks, states))
                    if s.state_of(c) is not st or id(st) in undone]
        constrained = any(c is not None for c in constraints)
        result = s.engine.launch(chunks, [st.request.params for st in states], [st.num_generated for st in states],
                                 constraints if constrained else None,
                                 before_masks=before_masks if constrained and flight is not None else None)
        tokens = sum(c.num_tokens for c in chunks)
        prefill = sum(c.num_tokens for c, st in zip(chunks, states) if not (c.num_tokens == 1 and st.num_generated))
        s.stats.prefill_tokens += prefill
        s.stats.steps += 1
        s.stats.step_tokens[tokens] += 1
        for chunk, st, d in zip(chunks, states, drew):
            if read and s.state_of(chunk) is not st:  # ended by the read inside the launch
                continue
            if s.snapshots is not None and id(st) not in undone:  # a roll-back's state is recomputed
                snapshot_at_launch(st, s.snapshots, s.engine, s.block_size)
            if d:
                seq = chunk.seq
                seq.token_ids.append(PENDING)
                st.num_generated += 1
                st.pending.append((len(seq.token_ids) - 1, st.num_generated))
                st.ending = st.num_generated >= st.request.params.max_tokens or \
                    len(seq.token_ids) >= s.config.max_model_len
        return InFlight(chunks, states, result, drew, tokens, prefill), (read[0] if read else None)

    def _read(self, flight: InFlight, began: float) -> list[TokenOutput]:
        """The step's tokens into their sequences, in order, as the plain step's do; a sequence finished or aborted
        since its launch is passed over, and one whose draw is stale is rolled back once no launch is open."""
        s = self.scheduler
        result = flight.result()
        outputs, now, stale = [], time.monotonic(), set(result.stale)
        for row, (chunk, st, drew) in enumerate(zip(flight.chunks, flight.states, flight.drew)):
            if s.state_of(chunk) is not st:
                continue
            if not drew:
                record_blocks(st, s.cache, s.snapshots, s.engine, copy=False)
                continue
            if not st.pending:
                continue  # rolled back: this row read a token that was never drawn
            index, generated = st.pending.popleft()
            if row in stale:
                self.rolling_back.append((st, index, generated))
                continue
            chunk.seq.token_ids[index] = result.tokens[row]
            record_blocks(st, s.cache, s.snapshots, s.engine, copy=False)
            outputs.append(s.emit(st, result.tokens[row], result.logprobs[row], now, generated, index + 1))
        s.last_step = StepRecord(began, time.monotonic() - began, len(flight.chunks), flight.tokens, flight.prefill,
                                 len(outputs))
        return outputs

    def _roll_back(self, state: RequestState, index: int, generated: int) -> None:
        """Forgets the unresolved draw at `index` and anything after it; the token before runs again, and the
        request's steps are plain from now on (its draws may need their logits on the host again)."""
        seq = state.seq
        del seq.token_ids[index:]
        seq.num_cached = index - 1
        state.num_generated, state.ending, state.overlappable = generated - 1, False, False
        state.pending.clear()
        self.plain_next = True
        if self.scheduler.allocator.state_slots:
            self.scheduler.preempt(state)
