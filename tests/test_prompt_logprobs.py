"""Prompt logprobs: on a live `serve --device cpu`, echo with logprobs gives one entry per prompt token (the first
null) equal to Hugging Face's float32 log-softmax of the tiny checkpoint, then the generated tokens' as without
echo; vLLM's prompt_logprobs field; and in the scheduler, a prompt cut into chunks scores as one does."""

import json

import httpx
import numpy as np
import pytest
import torch
import transformers

from live_server import NAME, start_server, stop_server
from pegainfer.frontends.load import load_model
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

PROMPT = [5, 17, 33, 2, 90, 41, 7, 66, 12, 3, 150, 9]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("prompt_logprobs") / "serve.log"
    server = start_server(tiny_checkpoint, "--no-prefix-cache", log=log)
    yield server
    stop_server(server)


def hf_logprobs(checkpoint, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def completion(server, **body) -> dict:
    reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_echo_with_logprobs_scores_the_prompt_as_hugging_face_does(server, tiny_checkpoint):
    echoed = completion(server, echo=True, logprobs=2)
    plain = completion(server, logprobs=2)
    expected = hf_logprobs(tiny_checkpoint, PROMPT)
    lp = echoed["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ours = np.array(lp["token_logprobs"][1:len(PROMPT)])
    np.testing.assert_allclose(ours, expected[np.arange(len(PROMPT) - 1), PROMPT[1:]], atol=2e-4)
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:len(PROMPT)])
    assert lp["token_logprobs"][len(PROMPT):] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert echoed["text"].endswith(plain["text"]) and lp["text_offset"][0] == 0


def test_streamed_echo_with_logprobs_assembles_into_the_whole_response(server):
    """The first chunk carries the echoed prompt and its logprobs (the first null), each later one its token's:
    joined, the text, the tokens, their logprobs and offsets are the non-streamed response's."""
    whole = completion(server, echo=True, logprobs=2)
    joined = {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "model": NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 2, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            (choice,) = json.loads(line[len("data: "):])["choices"]
            joined["text"] += choice["text"]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                joined[key] += (choice["logprobs"] or {}).get(key, [])
    assert joined["text"] == whole["text"] and joined["tokens"] == whole["logprobs"]["tokens"]
    assert joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None
    assert joined["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert joined["top_logprobs"][0] is None and len(joined["top_logprobs"]) == len(PROMPT) + 3


def test_vllm_prompt_logprobs_field(server, tiny_checkpoint):
    choice = completion(server, prompt_logprobs=1)
    entries = choice["prompt_logprobs"]
    expected = hf_logprobs(tiny_checkpoint, PROMPT)
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        own = entry[str(PROMPT[position])]
        assert own["logprob"] == pytest.approx(float(expected[position - 1, PROMPT[position]]), abs=2e-4)
        best = max(entry.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1


def test_a_chunked_prompt_scores_as_a_whole_one(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    params = SamplingParams(max_tokens=2, prompt_logprobs=0, ignore_eos=True)
    results = []
    for budget in (4, 64):
        engine = ReferenceEngine(model, max_tokens=512)
        scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget))
        scheduler.add(EngineRequest("r", PROMPT, params))
        outputs = []
        while scheduler.has_work():
            outputs += scheduler.step()
        results.append(outputs)
    chunked, whole = results
    assert [o.token_id for o in chunked] == [o.token_id for o in whole]
    steps = [chunked[0].prompt_logprobs, whole[0].prompt_logprobs]
    assert len(steps[0]) == len(PROMPT) - 1
    for a, b in zip(*steps):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=1e-5) for k in a)


def test_max_tokens_0_with_echo_scores_the_prompt_alone(server, tiny_checkpoint):
    choice = completion(server, echo=True, logprobs=0, max_tokens=0)
    expected = hf_logprobs(tiny_checkpoint, PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) and choice["finish_reason"] == "length"
    np.testing.assert_allclose(lp["token_logprobs"][1:], expected[np.arange(len(PROMPT) - 1), PROMPT[1:]],
                               atol=2e-4)
    reply = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 0})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"


def test_chat_gives_prompt_logprobs_too(server):
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()  # vLLM puts a chat's prompt_logprobs beside its choices
    entries, prompt_len = body["prompt_logprobs"], body["usage"]["prompt_tokens"]
    assert len(entries) == prompt_len and entries[0] is None
    assert all(len(entry) == 1 for entry in entries[1:])  # 0: the prompt's own token alone


MULTIBYTE = "caf\u00e9 \u65e5\u672c \U0001f642 ok"


def echoed_offsets(server, stream: bool) -> tuple[list[str], list[int]]:
    body = {"model": NAME, "prompt": MULTIBYTE, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 0, "stream": stream}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json=body) as reply:
        assert reply.status_code == 200
        lines = [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines()
                 if line.startswith(("{", "data: {"))]
    logprobs = [choice["logprobs"] or {} for line in lines for choice in line["choices"]]
    tokens = [t for lp in logprobs for t in lp.get("tokens", [])]
    return tokens, [o for lp in logprobs for o in lp.get("text_offset", [])]


def test_echoed_offsets_are_where_each_token_starts_in_the_text(server):
    """Characters of several bytes split over byte tokens: each whole token's offset is where its text stands in
    the echoed prompt, so the offsets never go back and the first generated one is the prompt's length; streamed
    or not, the same offsets."""
    tokens, offsets = echoed_offsets(server, stream=False)
    count = len(tokens) - 2
    assert "\ufffd" in "".join(tokens[:count]), tokens  # some characters were split over byte tokens
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[count] == len(MULTIBYTE), offsets
    whole = [(t, o) for t, o in zip(tokens[:count], offsets) if "\ufffd" not in t]
    assert len(whole) >= 6 and all(MULTIBYTE[o:o + len(t)] == t for t, o in whole), list(zip(tokens, offsets))
    assert echoed_offsets(server, stream=True) == (tokens, offsets)
