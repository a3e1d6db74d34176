"""`pegainfer serve --device cpu` on loopback, started by the tests on the tiny random checkpoint and driven by the
official `openai` client (and httpx where a client library would refuse to send the bad input): completions and
chat, streamed and not, stop strings, logprobs, outputs equal to `pegainfer generate`, every bad input with its
status and message, the API key, 64 concurrent streams, clients that leave midway, the prefix cache, bench serve."""

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from live_server import KEY, MAX_MODEL_LEN, NAME, start_server, stop_server
from pegainfer.cli import main

MAX_REQUEST_BYTES = 65536


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    log = folder / "serve.log"
    server = start_server(tiny_checkpoint, "--api-key", KEY, "--max-num-seqs", "64",
                          "--max-request-bytes", str(MAX_REQUEST_BYTES), "--trace-steps", str(folder / "trace.jsonl"),
                          log=log)
    yield server
    stop_server(server)


def generate_cli(capsys, checkpoint: Path, *args: str) -> dict:
    """`pegainfer generate --json` in this process: what the server's greedy output must equal."""
    assert main(["generate", "--model-path", str(checkpoint), "--json", "--device", "cpu", *args]) == 0
    return json.loads(capsys.readouterr().out)


# --- the API, happy paths ------------------------------------------------------------------------------------------

def test_health_models_and_startup_line(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    (model,) = server.client().models.list().data
    assert model.id == NAME and model.owned_by == "pegainfer"
    metrics = server.metrics()
    assert metrics["pegainfer:engine_healthy"] == 1 and metrics["pegainfer:startup_seconds"] > 0
    assert metrics["process_resident_memory_bytes"] > 10 << 20


@pytest.mark.parametrize("prompt", ["The server", "Once upon a time"])
def test_greedy_completion_equals_pegainfer_generate(server, capsys, prompt):
    expected = generate_cli(capsys, server.checkpoint, "--prompt", prompt, "--max-tokens", "12", "--ignore-eos",
                            "--logprobs", "2")
    result = server.client().completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                                logprobs=2, extra_body={"ignore_eos": True})
    (choice,) = result.choices
    assert choice.text == expected["text"] and choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(expected["prompt_token_ids"])
    assert result.usage.completion_tokens == 12 and result.usage.total_tokens == result.usage.prompt_tokens + 12
    chosen = [step[str(t)] for t, step in zip(expected["token_ids"], expected["logprobs"])]
    assert np.allclose(choice.logprobs.token_logprobs, chosen, atol=1e-6)
    assert all(len(top) >= 1 and max(top.values()) <= 0 for top in choice.logprobs.top_logprobs)
    by_ids = server.client().completions.create(model=NAME, prompt=expected["prompt_token_ids"], max_tokens=12,
                                                temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == expected["text"]


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(server):
    client = server.client()
    whole = client.completions.create(model=NAME, prompt="Hello world", max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=NAME, prompt="Hello world", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    plain = list(client.completions.create(model=NAME, prompt="Hello world", max_tokens=3, temperature=0,
                                           stream=True))
    assert all(c.usage is None for c in plain)


def test_echo_and_n_choices(server):
    client = server.client()
    echoed = client.completions.create(model=NAME, prompt="Echo me", max_tokens=4, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    plain = client.completions.create(model=NAME, prompt="Echo me", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "Echo me" + plain.choices[0].text
    many = client.completions.create(model=NAME, prompt=["a b", "c d e"], max_tokens=5, n=2, temperature=1.0,
                                     seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.completion_tokens == 20
    again = client.completions.create(model=NAME, prompt=["a b", "c d e"], max_tokens=5, n=2, temperature=1.0,
                                      seed=3, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in many.choices]  # seeded: reproducible


def chat_prompt_ids(server, messages) -> list[int]:
    response = server.post("/tokenize", {"messages": messages})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_chat_whole_and_streamed_equal_generate_on_the_rendered_prompt(server, capsys):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    ids = chat_prompt_ids(server, messages)
    tokenizer = Tokenizer.from_file(str(server.checkpoint / "tokenizer.json"))
    assert ids == tokenizer.encode("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay something."
                                   "<|im_end|>\n<|im_start|>assistant\n").ids
    assert server.post("/detokenize", {"tokens": ids}).json()["prompt"] == \
        "system\nYou are terse.\nuser\nSay something.\nassistant\n"  # special tokens skipped, as in outputs
    expected = generate_cli(capsys, server.checkpoint, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "9",
                            "--ignore-eos")
    client = server.client()
    whole = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=9, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == expected["text"] and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 9
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=9,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text"]
    assert chunks[-1].usage.completion_tokens == 9


def test_chat_logprobs(server):
    result = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=5, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == entry.top_logprobs[0].logprob <= 0  # greedy: the chosen token ranks first
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == result.choices[0].message.content


def find_cross_token_stop(server) -> tuple[str, str, str]:
    """A prompt and a 2-character stop string made of the last character of one generated token and the first of
    the next (whose first occurrence is there), with the greedy text."""
    for prompt in ["Once upon a time", "The server", "Hello world", "In the beginning", "The quick brown fox"]:
        result = server.client().completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                                    logprobs=0, extra_body={"ignore_eos": True})
        text, tokens = result.choices[0].text, result.choices[0].logprobs.tokens
        offset = 0
        for a, b in zip(tokens, tokens[1:]):
            offset += len(a)
            stop = a[-1:] + b[:1]
            if len(stop) == 2 and stop.isprintable() and "\ufffd" not in stop and text.find(stop) == offset - 1:
                return prompt, stop, text
    raise AssertionError("no printable pair of adjacent tokens in the greedy outputs")


def test_stop_strings_across_token_boundaries_are_cut_and_not_emitted(server):
    prompt, stop, text = find_cross_token_stop(server)
    client = server.client()
    result = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "@@@"],
                                       extra_body={"ignore_eos": True})
    assert result.choices[0].text == text[:text.index(stop)] and result.choices[0].finish_reason == "stop"
    assert 0 < result.usage.completion_tokens < 24
    streamed = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == text[:text.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_tokenize_and_detokenize(server):
    tokens = server.post("/tokenize", {"prompt": "naïve café"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    assert server.post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "naïve café"}


# --- bad input -----------------------------------------------------------------------------------------------------

LONG = [1 + i % 500 for i in range(MAX_MODEL_LEN + 19)]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,status,param,words", [
    (COMPLETIONS, b'{"prompt": "x", ', 400, None, ["not valid JSON"]),
    (COMPLETIONS, b'["prompt"]', 400, None, ["JSON object"]),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt", ["prompt", "required"]),
    (COMPLETIONS, {"prompt": 5}, 400, "prompt", ["list of token ids"]),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", ["integer", "ten"]),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, 400, "temperature", ["greater than or equal to 0"]),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p", ["less than or equal to 1"]),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p", ["greater than 0"]),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, 400, "top_k", ["-1"]),
    (COMPLETIONS, {"prompt": "x", "min_p": 2}, 400, "min_p", ["less than or equal to 1"]),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ["it needs echo"]),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ["greater than or equal to 0"]),
    (COMPLETIONS, {"prompt": "x", "n": 17}, 400, "n", ["16"]),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, "logprobs", ["20"]),
    (COMPLETIONS, {"prompt": "x", "seed": -1}, 400, "seed", ["greater than or equal to 0"]),
    (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "model", ["gpt-4", "does not exist", NAME]),
    (COMPLETIONS, {"prompt": LONG}, 400, "prompt", [str(MAX_MODEL_LEN), str(len(LONG))]),
    (COMPLETIONS, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens",
     [f"maximum context length is {MAX_MODEL_LEN}", f"{MAX_MODEL_LEN + 1} tokens"]),
    (COMPLETIONS, {"prompt": [3, 700]}, 400, "prompt", ["700", "0..511"]),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", ["empty"]),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", ["none of them empty"]),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [9999]}, 400, "stop_token_ids", ["9999"]),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty", ["less than or equal to 2"]),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", ["stream"]),
    (CHAT, {"messages": []}, 400, "messages", ["at least 1 item"]),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", ["required"]),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", ["robot"]),
    (CHAT, {"messages": "hi"}, 400, "messages", ["list"]),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", ["logprobs: true"]),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", ["20"]),
    (CHAT, {"messages": USER, "max_completion_tokens": MAX_MODEL_LEN}, 400, "max_completion_tokens",
     ["maximum context length"]),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages", ["maximum context length"]),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs", ["messages"]),
    (CHAT, {"messages": USER, "model": "other"}, 404, "model", ["other"]),
    ("/detokenize", {"tokens": [1, -3]}, 400, "tokens", ["-3"]),
    ("/tokenize", {}, 400, "prompt", ["exactly one of prompt and messages"]),
])
def test_bad_input_gets_an_openai_error_naming_the_parameter(server, path, body, status, param, words):
    response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_a_message_with_an_image_is_refused_with_400_and_the_server_goes_on(server):
    client = server.client()
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert bad.value.status_code == 400
    assert "content parts of type 'image_url' are not supported" in bad.value.message
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content[:1]}],
                                          max_tokens=2).usage.completion_tokens == 2


def test_the_openai_client_raises_its_exceptions_with_the_message(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=NAME, prompt="x", temperature=-1)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.chat.completions.create(model="nope", messages=USER)
    with pytest.raises(openai.BadRequestError, match="at least 1 item"):
        client.chat.completions.create(model=NAME, messages=[])


def test_api_key_is_required_on_v1_routes(server):
    with pytest.raises(openai.AuthenticationError) as wrong:
        server.client(key="wrong").completions.create(model=NAME, prompt="x", max_tokens=1)
    assert wrong.value.status_code == 401 and "api key" in str(wrong.value).lower()
    for key in (None, "wrong", KEY + "x"):
        response = server.post(COMPLETIONS, {"prompt": "x"}, key=key)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # outside /v1: no key needed


def test_request_bodies_are_size_limited(server):
    response = server.post(COMPLETIONS, {"prompt": "x" * MAX_REQUEST_BYTES})
    assert response.status_code == 413 and str(MAX_REQUEST_BYTES) in response.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is enforced as the body arrives
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1000 + 1):
            yield b"y" * 1000
        yield b'"}'
    response = httpx.post(server.url + COMPLETIONS, content=chunks(), headers={"Authorization": f"Bearer {KEY}",
                                                                                "Content-Type": "application/json"})
    assert response.status_code == 413
    assert server.client().completions.create(model=NAME, prompt="still here", max_tokens=2).usage


# --- load, disconnects, prefix cache -------------------------------------------------------------------------------

def random_prompt(rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(0, 500, length).tolist()


def test_64_concurrent_streams_each_return_exactly_max_tokens(server):
    rng = np.random.default_rng(5)
    prompts = [random_prompt(rng, int(rng.integers(4, 40))) for _ in range(64)]

    async def one(client: openai.AsyncOpenAI, prompt: list[int]) -> tuple[int, int, str]:
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0.8, seed=1,
                                                 logprobs=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        tokens, usage, finish = 0, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
                finish = choice.finish_reason or finish
        return tokens, usage.completion_tokens, finish

    async def run_all() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))
    results = asyncio.run(run_all())
    assert results == [(8, 8, "length")] * 64
    assert server.metrics()["pegainfer:kv_blocks_in_use"] == 0


def test_clients_leaving_midway_free_every_kv_block_and_the_server_goes_on(server):
    before = server.metrics()
    rng = np.random.default_rng(6)
    headers = {"Authorization": f"Bearer {KEY}"}

    async def stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, leave_after: int | None) -> int:
        body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "logprobs": 0}
        events = 0
        async with client.stream("POST", server.url + COMPLETIONS, json=body, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                events += line.startswith("data: {")
                if leave_after is not None and events == leave_after:
                    return events  # closes the connection with the completion far from done
        return events

    async def run_all() -> list[int]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as client:
            jobs = [stream(client, random_prompt(rng, 20), 400, 3) if i % 2 else
                    stream(client, random_prompt(rng, 20), 6, None) for i in range(64)]
            return await asyncio.gather(*jobs)
    started = time.monotonic()
    events = asyncio.run(run_all())
    assert events[1::2] == [3] * 32 and all(e == 6 for e in events[0::2])  # one event per token with logprobs
    deadline = time.monotonic() + 30
    while (metrics := server.metrics())["vllm:num_requests_running"] or metrics["pegainfer:kv_blocks_in_use"]:
        assert time.monotonic() < deadline, metrics
        time.sleep(0.1)
    assert time.monotonic() - started < 60  # 32 x 400 tokens were not generated for nobody
    assert metrics["vllm:num_requests_waiting"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0
    blocks = metrics["pegainfer:kv_blocks_free"] + metrics["pegainfer:kv_blocks_cached"]
    assert blocks == metrics["pegainfer:kv_blocks_total"]
    assert metrics["vllm:request_success_total:abort"] - before["vllm:request_success_total:abort"] == 32
    assert metrics["vllm:request_success_total:length"] - before["vllm:request_success_total:length"] == 32
    # the streams that left stopped well short of their 400 tokens (how soon depends on the machine's load: a
    # loaded 2-core machine has run 104 a stream before the disconnect reached the engine)
    assert metrics["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 32 * 6 + 32 * 200
    result = server.client().completions.create(model=NAME, prompt="after", max_tokens=3,
                                                extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 3


def test_a_shared_prefix_skips_its_prefill_and_keeps_the_greedy_output(server, capsys):
    rng = np.random.default_rng(7)
    prefix = random_prompt(rng, 100)  # 6 full blocks of 16
    first, second = prefix + [1, 2, 3], prefix + [7, 8]
    client = server.client()

    def complete(ids: list[int]):
        before = server.metrics()
        result = client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
        after = server.metrics()
        return result, {k: after[k] - before[k] for k in ("pegainfer:prefill_tokens_total",
                                                          "vllm:prefix_cache_hits_total",
                                                          "vllm:prefix_cache_queries_total")}
    cold, cold_delta = complete(first)
    assert cold_delta == {"pegainfer:prefill_tokens_total": 103, "vllm:prefix_cache_hits_total": 0,
                          "vllm:prefix_cache_queries_total": 103}
    warm, warm_delta = complete(second)
    assert warm_delta == {"pegainfer:prefill_tokens_total": 102 - 96, "vllm:prefix_cache_hits_total": 96,
                          "vllm:prefix_cache_queries_total": 102}
    assert warm.usage.prompt_tokens_details.cached_tokens == 96 and cold.usage.prompt_tokens_details.cached_tokens == 0
    expected = generate_cli(capsys, server.checkpoint, "--prompt-ids", ",".join(map(str, second)), "--max-tokens",
                            "6", "--ignore-eos")
    assert warm.choices[0].text == expected["text"]


def test_bench_serve_against_the_live_server(server, capsys, tmp_path):
    result_file = tmp_path / "bench.json"
    code = main(["bench", "serve", "--base-url", server.url, "--model", NAME, "--dataset", "random",
                 "--input-len", "24", "--output-len", "5", "--num-prompts", "6", "--max-concurrency", "3",
                 "--request-rate", "50", "--seed", "1", "--api-key", KEY, "--result-file", str(result_file),
                 "--tokenizer", str(server.checkpoint)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(result_file.read_text())
    assert report["command"].startswith("pegainfer bench serve --base-url") and report["card"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", report["date"]) and report["commit"]
    assert report["completed"] == 6 and report["total_output_tokens"] == 30
    assert 6 <= report["total_input_tokens"] <= 6 * 24 * 4  # random tokens decoded to text, re-encoded by the server
    assert report["errors"] == [] and report["max_concurrency"] == 3 and report["request_rate"] == 50
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 < report[f"p50_{name}"] <= report[f"p99_{name}"]
    assert report["output_throughput"] == pytest.approx(30 / report["duration_s"])
    for label in ("Successful requests", "Mean TTFT (ms)", "P99 TPOT (ms)", "P50 ITL (ms)", "Output token throughput"):
        assert label in out


def test_bench_serve_reports_failed_requests(server, capsys):
    code = main(["bench", "serve", "--base-url", server.url, "--model", "wrong-name", "--input-len", "4",
                 "--output-len", "2", "--num-prompts", "2", "--api-key", KEY, "--json"])
    captured = capsys.readouterr()
    assert code == 1 and json.loads(captured.out)["completed"] == 0
    assert "2 requests failed" in captured.err and "HTTP 404" in captured.err


def test_a_client_that_gives_up_on_a_whole_response_has_its_requests_aborted(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):  # 16 choices x 500 tokens: far more than a second of work
        httpx.post(server.url + COMPLETIONS, json={"prompt": [5, 6, 7], "max_tokens": 500, "n": 16,
                                                    "temperature": 1.0, "ignore_eos": True},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=httpx.Timeout(30, read=1.5))
    deadline = time.monotonic() + 10
    while (metrics := server.metrics())["vllm:num_requests_running"] or metrics["pegainfer:kv_blocks_in_use"]:
        assert time.monotonic() < deadline, metrics
        time.sleep(0.1)
    assert metrics["vllm:request_success_total:abort"] - before["vllm:request_success_total:abort"] == 16
    assert metrics["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 16 * 500


# --- a failed engine -----------------------------------------------------------------------------------------------

class BrokenEngine:
    """The reference engine's pool, and steps that raise as a GPU engine's do after a CUDA error."""

    def __init__(self, engine) -> None:
        self.allocator, self._engine = engine.allocator, engine

    def sample(self, chunks, params, token_index, constraints=None, launched=None):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

    def release(self, seq) -> None:
        self._engine.release(seq)


def test_a_failed_engine_answers_503_and_health_says_so(tiny_checkpoint):
    from pegainfer.frontends.load import load_model
    from pegainfer.runtime.chat import load_chat_template
    from pegainfer.runtime.engine_loop import EngineLoop
    from pegainfer.runtime.reference_engine import ReferenceEngine
    from pegainfer.runtime.scheduler import Scheduler
    from pegainfer.runtime.tokenizer import load_tokenizer
    from pegainfer.server.app import ServerContext, build_app
    from pegainfer.server.metrics import Metrics

    tokenizer = load_tokenizer(tiny_checkpoint)
    engine = BrokenEngine(ReferenceEngine(load_model(tiny_checkpoint), max_tokens=512))
    loop = EngineLoop(Scheduler(engine, tokenizer.eos_token_ids)).start()
    ctx = ServerContext(loop, tokenizer, load_chat_template(tiny_checkpoint), NAME, str(tiny_checkpoint), 256, 512,
                        Metrics(NAME))

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://pegainfer") as client:
            healthy = await client.get("/health")
            failed = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2})
            streamed = await client.post(CHAT, json={"messages": USER, "stream": True})
            return [healthy, failed, streamed, await client.get("/health"), await client.get("/metrics")]
    healthy, failed, streamed, health, metrics = asyncio.run(scenario())
    loop.stop()
    assert healthy.status_code == 200
    assert failed.status_code == 503 and "CUDA_ERROR_ILLEGAL_ADDRESS" in failed.json()["error"]["message"]
    assert streamed.status_code == 503  # refused before streaming starts: the engine is known dead
    assert health.status_code == 503 and "engine has failed" in health.json()["error"]["message"]
    assert "pegainfer:engine_healthy{model_name=\"tiny\"} 0" in metrics.text


def test_step_trace_accounts_for_every_generated_token(server):
    """--trace-steps: the JSON lines' outputs add up to the server's own generation-token counter."""
    server.client().completions.create(model=NAME, prompt="The trace", max_tokens=5, temperature=0)
    trace = server.log.parent / "trace.jsonl"
    deadline = time.monotonic() + 10
    while True:  # the line of a step is written just after its tokens go out
        lines = [json.loads(line) for line in trace.read_text().splitlines()]
        generated = server.metrics()["vllm:generation_tokens_total"]
        if sum(line["outputs"] for line in lines) == generated or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(line["outputs"] for line in lines) == generated >= 5
    assert all(line["seconds"] > 0 and line["tokens"] >= line["prefill_tokens"] >= 0 for line in lines)


def test_serve_refuses_a_trace_file_it_cannot_write(capsys, tiny_checkpoint, tmp_path):
    code = main(["serve", "--model-path", str(tiny_checkpoint), "--device", "cpu",
                 "--trace-steps", str(tmp_path / "missing" / "trace.jsonl")])
    err = capsys.readouterr().err
    assert code == 1 and "--trace-steps: cannot write" in err and err.count("\n") == 1


def test_serve_refuses_a_max_model_len_past_the_model(capsys, tiny_checkpoint):
    code = main(["serve", "--model-path", str(tiny_checkpoint), "--device", "cpu", "--max-model-len", "100000"])
    err = capsys.readouterr().err
    assert code == 1 and "--max-model-len 100000" in err and "max_position_embeddings 2048" in err


@pytest.mark.parametrize("value", ["1.5", "0", "lots"])
def test_serve_refuses_a_gpu_memory_utilization_outside_0_1(capsys, tiny_checkpoint, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model-path", str(tiny_checkpoint), "--device", "cpu", "--gpu-memory-utilization", value])
    assert exit_info.value.code == 2
    assert f"--gpu-memory-utilization: expected a fraction in (0, 1], got '{value}'" in capsys.readouterr().err
