"""Sampling penalties: the reference (ir/ops/penalties.py) against Hugging Face's RepetitionPenaltyLogitsProcessor and
vLLM's presence/frequency formula, min_tokens and logit_bias; a sequence's counts as it draws; and a live `serve
--device cpu` where logit_bias -100 keeps a token out, +100 forces one, min_tokens holds back EOS, and bad values are
a 400 naming their parameter."""

import httpx
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from live_server import NAME, start_server, stop_server
from pegainfer.ir.ops.penalties import Penalties, penalize
from pegainfer.runtime.constraint import PenaltyState, draw_constrained

VOCAB = 64


def test_repetition_penalty_matches_hugging_face():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(VOCAB).astype(np.float32) * 4
    history = [3, 9, 9, 17, 40]
    seen = np.zeros(VOCAB, dtype=bool)
    seen[history] = True
    ours = penalize(x, Penalties(repetition=1.7), seen, np.zeros(VOCAB, np.float32), 5, [])
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([history]), torch.tensor(x[None]))[0].numpy()
    np.testing.assert_allclose(ours, hf, rtol=1e-6)


def test_presence_frequency_bias_and_min_tokens():
    x = np.zeros(VOCAB, dtype=np.float32)
    counts = np.zeros(VOCAB, dtype=np.float32)
    counts[[5, 6, 6, 6]] = 0  # reset, then count 5 once and 6 three times
    counts[5], counts[6] = 1, 3
    seen = counts > 0
    out = penalize(x, Penalties(presence=0.5, frequency=0.25, logit_bias=((7, 2.0),), min_tokens=3), seen, counts,
                   produced=2, stop_ids=[0])
    assert out[5] == pytest.approx(-0.75) and out[6] == pytest.approx(-1.25) and out[7] == 2.0
    assert out[0] == -np.inf and out[1] == 0.0
    assert penalize(x, Penalties(min_tokens=3), seen, counts, 3, [0])[0] == 0.0  # enough tokens: EOS allowed


def test_penalty_state_counts_what_it_draws():
    state = PenaltyState(Penalties(frequency=1.0), prompt_ids=[1, 2], vocab_size=VOCAB, stop_ids=[0])
    x = np.zeros(VOCAB, dtype=np.float32)
    x[10] = 3.0
    tokens = [draw_constrained(x, state, (0.0, 0, 1.0, 0.0, 1, 0))[0] for _ in range(4)]
    assert tokens[:3] == [10, 10, 10] and tokens[3] != 10  # each draw of 10 costs it 1
    assert state.counts[10] == 3 and state.produced == 4 and state.seen[[1, 2, 10]].all()


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("penalties") / "serve.log"
    server = start_server(tiny_checkpoint, log=log)
    yield server
    stop_server(server)


def completion(server, **body) -> dict:
    reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": NAME, "prompt": "The server", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "logprobs": 1, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["logprobs"]


@pytest.mark.parametrize("seed", range(6))
def test_sparse_terms_give_exactly_what_the_dense_penalties_give(seed):
    """PenaltyState.terms through the penalize_tokens op (what the GPU tail applies) equals `adjust` (the dense
    reference the engines draw from on the host) bit for bit, over every kind of penalty at once, after draws."""
    from pegainfer.ir.ops.sampling import penalize_tokens

    rng = np.random.default_rng(seed)
    penalties = Penalties(presence=float(rng.uniform(-1, 1)), frequency=float(rng.uniform(-1, 1)),
                          repetition=float(rng.uniform(0.5, 2)), logit_bias=((3, 5.0), (40, -100.0), (9, 0.5)),
                          min_tokens=4, bad_words=((7,), (11, 12, 13)))
    state = PenaltyState(penalties, rng.integers(0, VOCAB, 10).tolist(), VOCAB, stop_ids=[0, 1])
    for token in [11, 12, *rng.integers(0, VOCAB, int(rng.integers(0, 6))).tolist(), 3, 11]:
        state.accept(token)  # the terms after each draw: the ids they carry are kept as tokens come
        x = (rng.standard_normal(VOCAB) * 4).astype(np.float32)
        x[rng.integers(0, VOCAB, 3)] = -np.inf  # a grammar's mask
        ids, terms = state.terms()
        assert (np.diff(ids) > 0).all()
        got = penalize_tokens(x[None], np.array([0], np.int32), np.array([ids.size], np.int32), ids, terms)[0]
        np.testing.assert_array_equal(got, state.adjust(x))


def test_logit_bias_keeps_a_token_out_and_forces_another(server):
    greedy = completion(server)
    banned = greedy["tokens"][0]  # greedy's first token, its argmax
    (banned_id,) = httpx.post(server.url + "/tokenize", json={"prompt": banned}).json()["tokens"]
    for seed in range(3):
        out = completion(server, temperature=1.0, seed=seed, logit_bias={str(banned_id): -100})
        assert banned not in out["tokens"], (banned, out["tokens"])
    forced = completion(server, temperature=1.0, seed=1, max_tokens=6, logit_bias={"42": 100})
    assert len(set(forced["tokens"])) == 1 and forced["tokens"][0] != banned


def test_repetition_penalty_changes_a_repetitive_greedy_output(server):
    base = dict(model=NAME, prompt="The server", max_tokens=24, temperature=0)
    plain = server.client().completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    penalised = server.client().completions.create(**base, extra_body={"ignore_eos": True,
                                                                       "repetition_penalty": 5.0}).choices[0].text
    assert penalised != plain


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": {"word": 5}}, "logit_bias"),
    ({"logit_bias": {"3": 500}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),
])
def test_bad_penalties_are_a_400_naming_them(server, body, param):
    reply = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 4, **body},
                       timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_a_bad_words_last_token_is_masked_only_after_the_rest_of_it():
    x = np.zeros(VOCAB, dtype=np.float32)
    seen, counts = np.zeros(VOCAB, dtype=bool), np.zeros(VOCAB, dtype=np.float32)
    rules = Penalties(bad_words=((7,), (3, 4, 5)))
    assert penalize(x, rules, seen, counts, 0, [], ())[7] == -np.inf  # a one-token word: always
    assert penalize(x, rules, seen, counts, 2, [], (9, 3))[5] == 0.0  # (3, 4) not yet written
    assert penalize(x, rules, seen, counts, 3, [], (9, 3, 4))[5] == -np.inf
    state = PenaltyState(rules, prompt_ids=[], vocab_size=VOCAB, stop_ids=[])
    for token in (3, 4):
        state.accept(token)
    assert state.adjust(x)[5] == -np.inf and state.adjust(x)[4] == 0.0


def test_bad_words_keep_the_greedy_first_token_out(server):
    greedy = completion(server)["tokens"]
    word = greedy[0].strip()
    if not word:
        pytest.skip("the greedy first token is whitespace")
    out = completion(server, bad_words=[word])["tokens"]
    assert greedy[0] not in out and word not in [token.strip() for token in out], (word, out)


def test_the_bias_comes_before_the_repetition_penalty_as_in_vllm():
    x = np.full(VOCAB, 2.0, dtype=np.float32)
    seen = np.zeros(VOCAB, dtype=bool)
    seen[3] = True
    out = penalize(x, Penalties(repetition=2.0, logit_bias=((3, 4.0),)), seen, np.zeros(VOCAB, np.float32), 1, [])
    assert out[3] == pytest.approx((2.0 + 4.0) / 2.0) and out[4] == 2.0


def test_min_tokens_holds_back_stop_strings_too(server):
    base = {"model": NAME, "prompt": "The server", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = httpx.post(server.url + "/v1/completions", json=base, timeout=120).json()["choices"][0]["text"]
    stop = text[1:3]  # a stop string found in the first tokens
    early = httpx.post(server.url + "/v1/completions", json=base | {"stop": [stop]}, timeout=120).json()
    late = httpx.post(server.url + "/v1/completions", json=base | {"stop": [stop], "min_tokens": 12},
                      timeout=120).json()
    assert early["choices"][0]["finish_reason"] == "stop" and early["choices"][0]["text"] == text[:text.index(stop)]
    assert late["choices"][0]["text"] == text and late["usage"]["completion_tokens"] == 12
