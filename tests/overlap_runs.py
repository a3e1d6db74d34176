"""Runs of the scheduler over the reference engine with and without async scheduling (runtime/overlap.py), its
launches and reads logged: the harness of tests/test_overlap.py and tests/test_overlap_constraints.py."""

from dataclasses import replace

import numpy as np

from pegainfer.ir.graph import Graph
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

class Tracing:
    """The reference engine, its launches and reads logged in order; `unresolve` marks the first row of the
    chosen launches stale with a garbage token, as the GPU engine returns a draw it could not settle, where the row
    has no constraint (the engine told it its token already) and a later launch came before the read."""

    def __init__(self, engine: ReferenceEngine, unresolve: frozenset[int] = frozenset(), overlaps: bool = True) -> None:
        self.engine, self.allocator, self.unresolve, self.overlaps = engine, engine.allocator, unresolve, overlaps
        self.penalties_in_tail = engine.penalties_in_tail
        self.log: list[tuple[str, int]] = []
        self.read_inside: list[int] = []  # launches that read the step before between their layers and their tail

    def launch(self, chunks, params, token_index, constraints=None, before_masks=None):
        index = sum(kind == "launch" for kind, _ in self.log)
        self.log.append(("launch", index))
        if before_masks is not None:
            self.read_inside.append(index)
        read = self.engine.launch(chunks, params, token_index, constraints, before_masks=before_masks)

        def result():
            later = self.log[-1] != ("launch", index)
            self.log.append(("read", index))
            out = read()
            if index in self.unresolve and later and not (constraints and constraints[0] is not None):
                out = replace(out, tokens=[-7, *out.tokens[1:]], stale=[0])
            return out
        return result

    def sample(self, chunks, params, token_index, constraints=None, launched=None):
        result = self.launch(chunks, params, token_index, constraints)
        if launched is not None:
            launched()
        return result()

    def step(self, chunks, *, all_logits=False):
        return self.engine.step(chunks, all_logits=all_logits)

    def release(self, seq) -> None:
        self.engine.release(seq)

    def copy_state(self, src: int, dst: int) -> None:
        self.engine.copy_state(src, dst)

    def overlapped(self) -> int:
        """Launches made while the step before was still unread."""
        unread, count = set(), 0
        for kind, index in self.log:
            if kind == "launch":
                count += bool(unread)
                unread.add(index)
            else:
                unread.discard(index)
        return count


def run(model, requests: list[EngineRequest], *, overlap: bool, eos: frozenset[int] = frozenset(),
        kv_tokens: int = 4096, unresolve: frozenset[int] = frozenset(), abort: tuple[str, int] | None = None,
        engine_overlaps: bool = True, check=None, graph: Graph | None = None,
        **config) -> tuple[dict, Scheduler, Tracing]:
    """Each request's (token, finish reason, logprobs) in order; `graph`: the engine's (a lowered one draws
    penalties in its tail, as the GPU's does)."""
    engine = Tracing(ReferenceEngine(model, max_tokens=kv_tokens, graph=graph), unresolve, engine_overlaps)
    scheduler = Scheduler(engine, eos, SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 32,
                                                          "async_scheduling": overlap, **config}))
    for request in requests:
        scheduler.add(request)
    outputs = {r.request_id: [] for r in requests}
    for step in range(500):
        if not scheduler.has_work():
            break
        if abort is not None and step == abort[1]:
            scheduler.abort(abort[0])  # False where it has finished already
        for out in scheduler.step():
            outputs[out.request_id].append((out.token_id, out.finish_reason, out.logprobs))
        if check is not None:
            check(scheduler)
    assert not scheduler.has_work() and scheduler.blocks_in_use == 0, \
        (scheduler.running, scheduler.in_flight, scheduler.blocks_in_use, outputs)
    return outputs, scheduler, engine


def assert_same(ahead: dict, plain: dict, atol: float = 1e-4) -> None:
    """Tokens and finish reasons equal; logprobs as near as another batch's rounding leaves them (a wasted row of a
    sequence that has stopped changes a step's batch)."""
    assert {k: [o[:2] for o in v] for k, v in ahead.items()} == {k: [o[:2] for o in v] for k, v in plain.items()}
    for request, outs in ahead.items():
        for (_, _, got), (_, _, want) in zip(outs, plain[request]):
            assert (got is None) == (want is None) and (got is None or got.keys() == want.keys()), request
            if got is not None:
                np.testing.assert_allclose(list(got.values()), list(want.values()), atol=atol)
