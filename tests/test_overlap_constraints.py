"""Async scheduling (runtime/overlap.py) of requests under a grammar or penalties: the step in flight is read between
the next step's layers and its sampler tail, so each mask follows the token drawn just before; the tokens are the
plain steps' and each grammar hears exactly its request's tokens (none of a wasted row after a late stop, none of a
draw rolled back); a row the tail cannot take is drawn again in plain steps; and which requests may overlap."""

from dataclasses import replace

import numpy as np
import pytest

from pegainfer.frontends.load import load_model
from pegainfer.ir.ops.penalties import Penalties
from pegainfer.ir.ops.sampling import UNRESOLVED
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.constraint import PenaltyState, pack_mask
from pegainfer.runtime.device_sampling import finish, greedy_inputs
from pegainfer.runtime.overlap import overlappable
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams

from overlap_runs import assert_same, run

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


@pytest.fixture(scope="module")
def vocab(model) -> int:
    return model.spec.graph.value_types()[model.spec.graph.outputs[0]].shape[-1]


class Walk:
    """A grammar for tests: from token t the next is one of `width` ids spread from t; after `length` tokens only
    `end`. It keeps what it was told, and what it was told but did not allow; `fail_at`: at that many tokens its
    bitmask fails (as a grammar library may), so that its row is drawn on the host from the logits."""

    def __init__(self, vocab: int, length: int = 100, end: int = 0, width: int = 4, fail_at: int = -1) -> None:
        self.vocab, self.length, self.end, self.width, self.fail_at = vocab, length, end, width, fail_at
        self.told: list[int] = []
        self.refused: list[int] = []

    def _ids(self) -> list[int]:
        if len(self.told) >= self.length:
            return [self.end]
        last = self.told[-1] if self.told else 1
        return [(last * 7 + 13 * k + 1) % self.vocab for k in range(self.width)]

    def allowed(self, vocab_size: int) -> np.ndarray:
        mask = np.zeros(vocab_size, dtype=bool)
        mask[self._ids()] = True
        return mask

    def bitmask(self, vocab_size: int) -> np.ndarray:
        if len(self.told) == self.fail_at:
            raise RuntimeError("the grammar library failed")
        return pack_mask(self.allowed(vocab_size))

    def accept(self, token: int) -> None:
        if token not in self._ids():
            self.refused.append(token)
        self.told.append(token)


def walking(vocab: int, prompts: list[list[int]], params: list[SamplingParams], **walk) -> list[EngineRequest]:
    """A request per prompt, each with a fresh Walk (a run tells its grammars tokens: each run needs its own)."""
    return [EngineRequest(f"w{i}", prompt, p, constraint=Walk(vocab, **walk))
            for i, (prompt, p) in enumerate(zip(prompts, params))]


def assert_told_their_tokens(requests: list[EngineRequest], outputs: dict) -> None:
    for request in requests:
        assert request.constraint.told == [token for token, _, _ in outputs[request.request_id]], request.request_id
        assert request.constraint.refused == [], request.request_id


PROMPTS = [[3, 4, 5, 6], list(range(20, 45)), [9, 8], list(range(60, 79))]
PARAMS = [GREEDY, SAMPLED, replace(GREEDY, logprobs=2, max_tokens=11), replace(SAMPLED, seed=4, max_tokens=5)]


def test_grammar_rows_go_ahead_and_draw_the_plain_steps_tokens(model, vocab):
    plain_requests, ahead_requests = walking(vocab, PROMPTS, PARAMS), walking(vocab, PROMPTS, PARAMS)
    others = [EngineRequest("free", [7, 7, 7], GREEDY)]
    plain, _, _ = run(model, plain_requests + others, overlap=False, max_num_seqs=8)
    ahead, _, engine = run(model, ahead_requests + others, overlap=True, max_num_seqs=8)
    assert_same(ahead, plain)
    assert_told_their_tokens(plain_requests, plain)
    assert_told_their_tokens(ahead_requests, ahead)
    assert engine.overlapped() >= 5 and len(engine.read_inside) >= 5, engine.log


def test_a_grammar_ending_a_request_hears_nothing_of_the_wasted_row_after(model, vocab):
    """Each walk ends on `end` after 3 tokens, a stop token: the async steps learn it a step late."""
    end = 17
    params = [replace(p, ignore_eos=False) for p in PARAMS]
    plain_requests, ahead_requests = (walking(vocab, PROMPTS, params, length=3, end=end) for _ in range(2))
    plain, _, _ = run(model, plain_requests, overlap=False, eos=frozenset({end}), max_num_seqs=8)
    ahead, _, engine = run(model, ahead_requests, overlap=True, eos=frozenset({end}), max_num_seqs=8)
    assert_same(ahead, plain)
    assert all([o[1] for o in outs] == [None, None, None, "stop"] for outs in ahead.values())
    assert_told_their_tokens(ahead_requests, ahead)
    assert engine.read_inside


def test_a_grammar_row_drawn_on_the_host_is_rolled_back_and_drawn_again_in_plain_steps(model, vocab):
    """At its third token the first walk's bitmask fails: the row needs its logits, which the next launch has
    overwritten by the time it is read (the GPU's logits; the reference engine says so too)."""
    plain_requests, ahead_requests = (walking(vocab, PROMPTS, PARAMS) for _ in range(2))
    for requests in (plain_requests, ahead_requests):
        requests[0].constraint.fail_at = 2
    plain, _, _ = run(model, plain_requests, overlap=False, max_num_seqs=8)
    ahead, scheduler, engine = run(model, ahead_requests, overlap=True, max_num_seqs=8)
    assert_same(ahead, plain)
    assert_told_their_tokens(ahead_requests, ahead)
    assert engine.overlapped() > 0
    last = max(i for i, (kind, _) in enumerate(engine.log) if kind == "launch")
    assert engine.log[last - 1][0] == "read"  # the request ran plain steps to its end


def penalized(vocab: int, prompts: list[list[int]], params: list[SamplingParams]) -> list[EngineRequest]:
    penalties = Penalties(presence=0.6, frequency=0.4, repetition=1.3, logit_bias=((5, 3.0),))
    return [EngineRequest(f"p{i}", prompt, p, constraint=PenaltyState(penalties, prompt, vocab, []))
            for i, (prompt, p) in enumerate(zip(prompts, params))]


def test_penalty_rows_go_ahead_where_the_tail_draws_them(model, vocab):
    """On a lowered graph, as on the GPU, the sampler tail draws rows under their penalties."""
    graph = lower(model.spec.graph)[0]
    params = [p for p in PARAMS if not p.logprobs]
    plain, _, _ = run(model, penalized(vocab, PROMPTS, params), overlap=False, max_num_seqs=8, graph=graph)
    ahead, _, engine = run(model, penalized(vocab, PROMPTS, params), overlap=True, max_num_seqs=8, graph=graph)
    assert_same(ahead, plain)
    assert engine.overlapped() >= 5 and len(engine.read_inside) >= 5, engine.log


def test_which_requests_may_overlap(vocab):
    class AllowedOnly:  # a grammar without a bitmask: the host draws each row from its logits
        def allowed(self, vocab_size: int) -> np.ndarray:
            return np.ones(vocab_size, dtype=bool)

        def accept(self, token: int) -> None:
            pass
    penalties = PenaltyState(Penalties(presence=0.5), [1], vocab, [])
    assert overlappable(EngineRequest("a", [1], GREEDY), False)
    assert overlappable(EngineRequest("a", [1], replace(GREEDY, logprobs=3), constraint=Walk(vocab)), False)
    assert overlappable(EngineRequest("a", [1], GREEDY, constraint=penalties), True)
    assert not overlappable(EngineRequest("a", [1], GREEDY, constraint=penalties), False)  # the engine's tail cannot
    assert not overlappable(EngineRequest("a", [1], replace(GREEDY, logprobs=3), constraint=penalties), True)
    assert not overlappable(EngineRequest("a", [1], GREEDY, constraint=AllowedOnly()), True)
    assert not overlappable(EngineRequest("a", [1], replace(GREEDY, prompt_logprobs=1)), True)


def test_rows_whose_logits_are_gone_are_left_undrawn_and_their_grammars_untold(vocab):
    walks = [Walk(vocab), Walk(vocab), Walk(vocab)]
    tail = {"sampled_ids": np.array([UNRESOLVED, walks[1]._ids()[0], 2]), "sampled_logprobs": np.zeros(3)}
    masks = {1: walks[1].bitmask(vocab)}  # row 2's grammar gave no mask: its draw needs the logits
    result = finish(tail, greedy_inputs(3), [GREEDY] * 3, lambda row: pytest.fail("no logits are left"),
                    [None, walks[1], walks[2]], masks, logits_gone=True)
    assert result.stale == [0, 2] and result.tokens == [UNRESOLVED, walks[1].told[0], UNRESOLVED]
    assert [len(w.told) for w in walks] == [0, 1, 0]
