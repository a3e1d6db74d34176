"""The scheduler's side of speculative decoding (runtime/speculative.py): which decoding sequences get drafts,
their drafts appended as the step's extra tokens, and after the step the drafts the target's draws keep. A
sequence of a model with recurrent layers has its state row copied to a spare row before its drafts run, and
restored when one is rejected: the kept tokens then run again in the next step."""

from collections.abc import Callable

import numpy as np

from pegainfer.runtime.speculative import DraftRequest, Speculator, accepted_count
from pegainfer.runtime.step_stats import SchedulerStats


class SpecSteps:
    def __init__(self, speculator: Speculator, engine, recurrent: bool, config, stats: SchedulerStats) -> None:
        """`config`: the scheduler's (max_num_seqs, max_model_len); a model with `recurrent` layers needs a spare
        state row for each sequence the scheduler may run."""
        spare_rows = engine.allocator.spare_rows
        if recurrent and len(spare_rows) < config.max_num_seqs:
            raise ValueError(f"speculative decoding of a model with recurrent layers needs a spare state row for "
                             f"each of max_num_seqs ({config.max_num_seqs}) sequences, to roll back past rejected "
                             f"drafts; the engine has {len(spare_rows)}")
        self.speculator, self.engine, self.recurrent = speculator, engine, recurrent
        self.max_model_len, self.stats = config.max_model_len, stats
        self.spares = list(spare_rows)  # free spare state rows

    def propose(self, running: list) -> dict[int, list[int]]:
        """Drafts for the decoding sequences that may speculate: those without a constraint (a grammar or
        penalties would see tokens that are not yet the sequence's), each up to K and to what its limits leave."""
        config = self.speculator.config
        if (config.disable_by_batch_size or len(running)) < len(running):
            return {}
        wanted = []
        for state in running:
            seq, params = state.seq, state.request.params
            room = min(config.num_speculative_tokens, params.max_tokens - state.num_generated - 1,
                       self.max_model_len - len(seq.token_ids) - 1)
            if len(seq.token_ids) - seq.num_cached == 1 and room > 0 and state.request.constraint is None:
                wanted.append(DraftRequest(seq.seq_id, seq.token_ids, room))
        found = self.speculator.proposer.propose(wanted) if wanted else []
        return {request.seq_id: draft for request, draft in zip(wanted, found) if draft}

    def fit(self, state, draft: list[int], room: int, reserve_for: Callable[[int], bool]) -> list[int]:
        """The drafts a decoding sequence verifies this step, appended to its tokens: at most `room`, and only
        when `reserve_for(count)` finds the blocks of `count` more tokens without preempting anyone."""
        draft = draft[:max(room, 0)]
        if not draft or not reserve_for(len(draft)):
            return []
        state.drafts = draft
        state.seq.token_ids += draft
        if self.recurrent:  # the recurrent state as of now, should a draft be rejected
            state.spare = self.spares.pop()
            self.engine.copy_state(state.seq.table.state_slot, state.spare)
        return draft

    def settle(self, state, draws: list[int]) -> int:
        """Keeps the drafts the target's draws agree with: the rest leave the sequence's tokens and its cache
        (their KV slots are past num_cached, to be overwritten). Returns how many draws become tokens."""
        drafts, seq, stats = state.drafts, state.seq, self.stats
        kept = accepted_count(drafts, draws)
        del seq.token_ids[len(seq.token_ids) - len(drafts):]
        seq.num_cached -= len(drafts) - kept
        if state.spare >= 0:
            if kept < len(drafts):
                self.engine.copy_state(state.spare, seq.table.state_slot)
                seq.num_cached -= kept + 1
            self.spares.append(state.spare)
            state.spare = -1
        state.drafts = []
        stats.spec_drafts += 1
        stats.spec_draft_tokens += len(drafts)
        stats.spec_accepted_tokens += kept
        stats.spec_accepted_by_position.update(range(kept))
        return kept + 1

    def observe(self, seq_id: int, start: int, rows: np.ndarray) -> None:
        """The target's features of the positions a step kept, for a drafter that reads them."""
        self.speculator.proposer.observe(seq_id, start, rows)

    def release(self, seq_id: int) -> None:
        self.speculator.proposer.release(seq_id)
