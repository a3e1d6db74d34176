"""Tokens a step in flight will draw, as the next step reads them (async scheduling, runtime/overlap.py): the
scheduler appends PENDING to a sequence for each draw it has not read yet, and the engine fills each such input
row from the earlier step's draws where they lie (the GPU engine: device-to-device copies queued before the step's
kernels; the CPU engine: from the tokens it drew)."""

import numpy as np

from pegainfer.runtime.batch import Chunk

PENDING = -1  # a token id that a launched step draws and the host has not read yet


def pending_rows(chunks: list[Chunk], starts: np.ndarray, drawn: dict[int, int]) -> list[tuple[int, int]]:
    """(input row, row of the earlier step's draws) of each chunk whose token is pending: a decode chunk of one
    token, drawn by the step launched before (`drawn`: seq_id -> its draw's row there)."""
    pairs = []
    for chunk, start in zip(chunks, starts):
        seq = chunk.seq
        if seq.token_ids[seq.num_cached + chunk.num_tokens - 1] != PENDING:
            continue
        assert chunk.num_tokens == 1 and seq.seq_id in drawn, \
            f"sequence {seq.seq_id}: a pending token must be a decode chunk's, drawn by the step before"
        pairs.append((int(start), drawn[seq.seq_id]))
    return pairs


def copy_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The pairs as (destination row, source row, count) runs where both sides are consecutive: one copy each."""
    runs: list[list[int]] = []
    for dst, src in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == dst and runs[-1][1] + runs[-1][2] == src:
            runs[-1][2] += 1
        else:
            runs.append([dst, src, 1])
    return [tuple(run) for run in runs]
