"""Drafters that read the target's hidden states (EAGLE-3 heads, MTP heads): the target step gives a row of
features for every token it runs (frontends/features.py), which the scheduler hands over for the positions it
keeps; the head runs on an engine of its own with its own KV cache, one position behind the target: at position p
it reads the token at p + 1 and the target's features at p, and gives a draft for p + 2. Further drafts read the
head's own output in place of the target's features, so its cache past the target's positions is rewritten at the
next proposal."""

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pegainfer.ir.graph import Graph
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.step import EMBED_GATE, FEATURES_INPUT
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step
from pegainfer.runtime.kv_blocks import BlockAllocator, OutOfBlocks
from pegainfer.runtime.speculative import DraftRequest


@dataclass
class _Draft:
    seq: Sequence
    features: list[np.ndarray] = field(default_factory=list)  # the target's, from position `first` on
    first: int = 0  # the position of features[0]: those before it are read no more (kept)
    valid: int = 0  # positions of the head's cache computed from the target's features

    @property
    def end(self) -> int:
        return self.first + len(self.features)

    def keep_from(self, position: int) -> None:
        """Drops the rows before `position` (the host holds a few rows a sequence, not its whole context)."""
        del self.features[:max(position - self.first, 0)]
        self.first = max(self.first, position)


class HeadRunner(Protocol):
    """Runs a head's steps over its own KV cache (InterpretedHead on the CPU, runtime/gpu/head.py's GpuHead)."""
    allocator: BlockAllocator

    def run(self, first: bool, chunks: list[Chunk], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step of `first` (over the target's features) or `next` (over the head's own output), committed:
        (each chunk's greedy draft in the head's vocabulary, the head's output at each chunk's last position)."""
        ...


class InterpretedHead:
    """The head's two graphs on the reference interpreter, over one KV cache of `kv_tokens`."""

    def __init__(self, first: Graph, next_graph: Graph, weights: Mapping[str, np.ndarray], kv_tokens: int,
                 block_size: int = 16) -> None:
        self.graphs, self.weights = {True: first, False: next_graph}, weights
        self.allocator = BlockAllocator(-(-kv_tokens // block_size), block_size)
        sizes = {"num_blocks": self.allocator.num_blocks, "block_size": block_size}
        self.states = {name: np.zeros(t.concrete(sizes), t.dtype.np_dtype)
                       for name, t in first.expanded_states().items()}

    def run(self, first: bool, chunks: list[Chunk], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        graph = self.graphs[first]
        inputs = pack_step(chunks, self.allocator)
        inputs |= head_inputs(graph, inputs["positions"], features)
        logits, out = run_graph(graph, inputs, self.weights, self.states)
        commit_step(chunks)
        return np.argmax(logits, axis=-1), out[np.cumsum([c.num_tokens for c in chunks]) - 1]


def head_inputs(graph: Graph, positions: np.ndarray, features: np.ndarray) -> dict[str, np.ndarray]:
    """A head step's own inputs beside pack_step's: the features it reads and, where it takes one, the gate
    dropping the embedding at position 0."""
    inputs = {FEATURES_INPUT: features}
    if EMBED_GATE in graph.inputs:
        inputs[EMBED_GATE] = (positions != 0).astype(np.float32)[:, None]
    return inputs


class FeatureDrafter:
    """Drafts with a head on `runner`: its `first` graph reads the target's features, `next` (the same weights
    and cache) the head's own output. `to_target` maps draft-vocabulary ids to the target's (EAGLE-3's d2t)."""

    def __init__(self, runner: HeadRunner,
                 to_target: Callable[[np.ndarray], np.ndarray] = lambda ids: ids) -> None:
        self.runner, self.to_target = runner, to_target
        self.drafts: dict[int, _Draft] = {}

    def observe(self, seq_id: int, start: int, rows: np.ndarray) -> None:
        """The target's features at positions start .. start + len(rows) - 1 (those after them are stale).
        Positions the target never ran (a prefix-cache hit, a scored prompt) read zeros: the head's drafts over
        them are worse, never wrong, as the target verifies every one."""
        draft = self.drafts.setdefault(seq_id, _Draft(Sequence(seq_id, [])))
        if start < draft.first:  # the target runs positions again from before the rows kept (a preemption)
            draft.features, draft.first = [], start
        if start > draft.end:
            draft.features.extend(np.zeros((start - draft.end, rows.shape[1]), rows.dtype))
        del draft.features[start - draft.first:]
        draft.features.extend(rows)
        draft.valid = min(draft.valid, start)

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        proposed: list[list[int]] = [[] for _ in requests]
        ready = [i for i, r in enumerate(requests) if r.k > 0 and r.seq_id in self.drafts
                 and self.drafts[r.seq_id].end >= len(r.tokens) - 1]
        try:
            chunks, features = self._catch_up([requests[i] for i in ready])
            if not chunks:
                return proposed
            tokens, own = self._run(True, chunks, features)
            active = ready
            while True:
                for i, token in zip(active, tokens):
                    proposed[i].append(int(token))
                still = [j for j, i in enumerate(active) if len(proposed[i]) < requests[i].k]
                if not still:
                    break
                active = [active[j] for j in still]
                chunks = [self._extend(self.drafts[requests[i].seq_id].seq, proposed[i][-1]) for i in active]
                tokens, own = self._run(False, chunks, own[still])
        except OutOfBlocks:  # the head's cache is full: no drafts this step
            return [[] for _ in requests]
        for i in ready:  # a later catch-up starts at the head's cache or the target's rows, whichever is first
            draft = self.drafts[requests[i].seq_id]
            draft.keep_from(min(draft.seq.num_cached, draft.valid))
        return proposed

    def release(self, seq_id: int) -> None:
        draft = self.drafts.pop(seq_id, None)
        if draft is not None:
            self.runner.allocator.release(draft.seq.table)

    def _catch_up(self, requests: list[DraftRequest]) -> tuple[list[Chunk], np.ndarray]:
        """Each sequence's positions from its first not computed from the target's features to its newest one
        with them (the target's last token but one), as chunks of the head's sequence (tokens shifted by one)."""
        chunks, features = [], []
        for request in requests:
            draft = self.drafts[request.seq_id]
            end = len(request.tokens) - 1
            draft.seq.token_ids = list(request.tokens[1:])
            start = draft.seq.num_cached = min(draft.seq.num_cached, draft.valid, end - 1)
            assert start >= draft.first, f"rows from {start} asked, kept from {draft.first}"
            chunks.append(Chunk(draft.seq, end - start))
            features += draft.features[start - draft.first:end - draft.first]
            draft.valid = end
        return chunks, np.stack(features) if features else np.zeros((0, 0), np.float32)

    def _extend(self, seq: Sequence, token: int) -> Chunk:
        seq.token_ids.append(token)
        return Chunk(seq, 1)

    def _run(self, first: bool, chunks: list[Chunk], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(each chunk's draft token, the head's output at each chunk's last position)."""
        tokens, own = self.runner.run(first, chunks, features)
        return self.to_target(tokens), own
