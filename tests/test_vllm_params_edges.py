"""Edge cases of vLLM's request parameters against a live `serve --device cpu` carrying Qwen3's chat template, the
qwen3 reasoning parser and hermes tool calls, its tokenizer putting a BOS before a text (add_special_tokens)."""

import pytest
from tokenizers import Tokenizer, processors

from live_server import NAME, start_server, stop_server, with_chat_template

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    checkpoint = checkpoint_factory("vllm_edges", seed=5)
    with_chat_template(checkpoint)
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>",
                                                                                                     bos)])
    tok.save(str(checkpoint / "tokenizer.json"))
    log = tmp_path_factory.mktemp("edges") / "serve.log"
    server = start_server(checkpoint, "--max-model-len", "256", "--enable-auto-tool-choice", "--tool-call-parser",
                          "hermes", "--reasoning-parser", "qwen3", log=log)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def tokenizer(server) -> Tokenizer:
    return Tokenizer.from_file(str(server.checkpoint / "tokenizer.json"))


def post(server, path: str, **body) -> dict:
    reply = server.post(path, {"model": NAME, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def complete(server, **body) -> dict:
    return post(server, "/v1/completions", **({"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                               "ignore_eos": True} | body))


def chat(server, **body) -> dict:
    return post(server, "/v1/chat/completions", **({"messages": [{"role": "user", "content": PROMPT}],
                                                    "max_tokens": 8, "temperature": 0} | body))


def streamed_completions(server, **body) -> dict[int, dict]:
    """Per choice index: the streamed text, token ids, finish_reason and stop_reason."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True} | body
    out: dict[int, dict] = {}
    for chunk in server.events("/v1/completions", body):
        for c in chunk["choices"]:
            got = out.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None,
                                              "stop_reason": None})
            got["text"] += c["text"]
            got["token_ids"] += c.get("token_ids") or []
            if c["finish_reason"] is not None:
                got["finish_reason"], got["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    return out


def streamed_chat(server, **body) -> dict[int, dict]:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0} | body
    out: dict[int, dict] = {}
    for chunk in server.events("/v1/chat/completions", body):
        for c in chunk["choices"]:
            got = out.setdefault(c["index"], {"content": "", "reasoning": "", "token_ids": [], "finish_reason": None,
                                              "stop_reason": None})
            got["content"] += c["delta"].get("content") or ""
            got["reasoning"] += c["delta"].get("reasoning_content") or ""
            got["token_ids"] += c.get("token_ids") or []
            if c["finish_reason"] is not None:
                got["finish_reason"], got["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    return out


# --- stop strings and stop tokens ---------------------------------------------------------------------------------

def test_include_stop_str_whole_and_streamed_agree_for_every_choice(server):
    sampled = {"temperature": 1.0, "seed": 11, "n": 3, "max_tokens": 16, "return_token_ids": True}
    free = complete(server, **sampled)["choices"]
    stop = free[0]["text"][4:6]
    body = sampled | {"stop": [stop], "include_stop_str_in_output": True}
    whole = complete(server, **body)["choices"]
    streamed = streamed_completions(server, **body)
    for choice in whole:
        got = streamed[choice["index"]]
        assert (got["text"], got["token_ids"], got["finish_reason"], got["stop_reason"]) == \
            (choice["text"], choice["token_ids"], choice["finish_reason"], choice["stop_reason"])
        if choice["finish_reason"] == "stop":
            assert choice["text"].endswith(stop) and choice["stop_reason"] == stop
        free_text = free[choice["index"]]["text"]
        assert free_text.startswith(choice["text"])


def test_text_offsets_index_the_text_with_echo_and_include_stop(server, tokenizer):
    greedy = complete(server)["choices"][0]["text"]
    stop = greedy[5:7]
    choice = complete(server, stop=[stop], include_stop_str_in_output=True, echo=True, logprobs=1)["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT + greedy[:greedy.find(stop) + len(stop)]
    assert len(lp["tokens"]) == len(lp["text_offset"]) == len(lp["token_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len(choice["text"])
    assert lp["token_logprobs"][0] is None  # the echoed prompt's first token (the BOS)


def test_a_stop_token_whole_and_streamed_with_logprobs(server):
    whole = complete(server, return_token_ids=True)["choices"][0]
    stop_id = whole["token_ids"][3]
    body = {"stop_token_ids": [stop_id], "logprobs": 1, "return_token_ids": True}
    cut = complete(server, **body)["choices"][0]
    assert cut["token_ids"][-1] == stop_id and cut["stop_reason"] == stop_id
    assert len(cut["logprobs"]["tokens"]) == len(cut["token_ids"]) and cut["logprobs"]["text_offset"][-1] <= \
        len(cut["text"])
    got = streamed_completions(server, **body)[0]
    assert (got["text"], got["token_ids"], got["stop_reason"]) == (cut["text"], cut["token_ids"], stop_id)
    chat_whole = chat(server, ignore_eos=True, max_tokens=8, return_token_ids=True)["choices"][0]
    chat_stop = chat_whole["token_ids"][2]
    answer = chat(server, stop_token_ids=[chat_stop], ignore_eos=True)["choices"][0]
    streamed = streamed_chat(server, stop_token_ids=[chat_stop], ignore_eos=True)[0]
    assert answer["stop_reason"] == streamed["stop_reason"] == chat_stop
    assert (answer["message"]["content"] or "") == streamed["content"]


# --- allowed_token_ids --------------------------------------------------------------------------------------------

def test_allowed_token_ids_hold_under_bias_penalties_and_n(server):
    allowed = [40, 41, 97, 120]
    body = {"allowed_token_ids": allowed, "logit_bias": {"50": 100}, "presence_penalty": 1.5,
            "repetition_penalty": 1.3, "n": 3, "temperature": 1.0, "seed": 3, "return_token_ids": True}
    for choice in complete(server, **body)["choices"]:
        assert set(choice["token_ids"]) <= set(allowed), choice
    for got in streamed_completions(server, **body).values():
        assert len(got["token_ids"]) == 12 and set(got["token_ids"]) <= set(allowed)
    top = complete(server, allowed_token_ids=allowed, logprobs=3, frequency_penalty=1.0, return_token_ids=True)
    assert set(top["choices"][0]["token_ids"]) <= set(allowed)


def test_allowed_token_ids_leave_the_logprobs_raw(server):
    """vLLM's sampler takes its (raw) logprobs before it masks the ids allowed_token_ids leaves out: a token's
    logprob is the same with the list as without it, never renormalized over the list."""
    free = complete(server, max_tokens=1, logprobs=0, return_token_ids=True)["choices"][0]
    (token,), (logprob,) = free["token_ids"], free["logprobs"]["token_logprobs"]
    assert logprob < -1e-3  # the greedy token is not certain: a renormalized logprob would read 0
    listed = complete(server, max_tokens=1, logprobs=0, allowed_token_ids=[token], return_token_ids=True)
    assert listed["choices"][0]["token_ids"] == [token]
    assert listed["choices"][0]["logprobs"]["token_logprobs"][0] == pytest.approx(logprob, abs=1e-4)


def test_an_eos_among_stop_token_ids_is_an_eos_without_stop_reason(server, tokenizer):
    """vLLM checks the end-of-sequence token before stop_token_ids: stop_reason None."""
    eos = tokenizer.token_to_id("<|im_end|>")
    body = {"max_tokens": 4, "allowed_token_ids": [eos], "stop_token_ids": [eos], "ignore_eos": False}
    choice = complete(server, **body)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert streamed_completions(server, **body)[0]["stop_reason"] is None
    assert complete(server, **body | {"ignore_eos": True})["choices"][0]["stop_reason"] == eos


# --- truncate_prompt_tokens and add_special_tokens ----------------------------------------------------------------

def test_truncation_keeps_the_bos_and_counts_it(server, tokenizer):
    text = PROMPT * 4
    ids = tokenizer.encode(text).ids
    assert ids[0] == tokenizer.token_to_id("<|endoftext|>")  # the checkpoint's tokenizer adds a BOS
    kept = complete(server, prompt=text, truncate_prompt_tokens=6, return_token_ids=True)["choices"][0]
    assert kept["prompt_token_ids"] == ids[:1] + ids[-5:]
    bare = complete(server, prompt=text, truncate_prompt_tokens=6, add_special_tokens=False, return_token_ids=True)
    assert bare["choices"][0]["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False).ids[-6:]
    whole = complete(server, prompt=text, truncate_prompt_tokens=-1, return_token_ids=True)["choices"][0]
    assert whole["prompt_token_ids"] == ids


def test_truncation_to_nothing_is_a_400(server):
    """truncate_prompt_tokens 0 keeps no token, with the tokenizer's BOS or without it."""
    for body in ({"prompt": PROMPT, "add_special_tokens": False}, {"prompt": [5, 6, 7]}, {"prompt": PROMPT}):
        reply = server.post("/v1/completions", {"model": NAME, "max_tokens": 2, "truncate_prompt_tokens": 0} | body)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "truncate_prompt_tokens", reply.text
    reply = server.post("/v1/chat/completions", {"model": NAME, "max_tokens": 2, "truncate_prompt_tokens": 0,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400, reply.text


def test_a_truncated_echo_has_offsets_into_its_text(server, tokenizer):
    """With echo, each prompt token's text_offset is where its text stands in the echoed text."""
    text = "alpha beta gamma delta epsilon"
    choice = complete(server, prompt=text, truncate_prompt_tokens=4, add_special_tokens=False, echo=True,
                      logprobs=0, max_tokens=2, return_token_ids=True)["choices"][0]
    lp, echoed = choice["logprobs"], choice["text"]
    for token, offset in zip(lp["tokens"][:4], lp["text_offset"][:4]):
        assert echoed[offset:offset + len(token)] == token, (echoed, lp["tokens"], lp["text_offset"])


# --- chat: continue_final_message, echo ---------------------------------------------------------------------------

CONTINUED = [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "It is"}]


def test_continue_final_message_under_qwen3s_template_is_content_whole_and_streamed(server, tokenizer):
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True,
            "return_token_ids": True, "ignore_eos": True}
    answer = chat(server, **body)
    prompt = tokenizer.decode(answer["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt is")
    message = answer["choices"][0]["message"]
    streamed = streamed_chat(server, **body)[0]
    assert streamed["content"] == (message["content"] or "")
    assert streamed["reasoning"] == (message.get("reasoning_content") or "")
    echoed = chat(server, **body, echo=True)["choices"][0]["message"]
    assert echoed["content"] == "It is" + (message["content"] or "")
    assert streamed_chat(server, **body, echo=True)[0]["content"] == echoed["content"]


def test_continue_final_message_past_the_reasoning_is_constrained_from_its_first_token(server):
    """Under Qwen3's template the continued assistant message stands after its closed <think></think>: the
    reasoning has ended in the prompt (vLLM's is_reasoning_end(prompt_token_ids)), so a response_format holds from
    the first token and the answer is content, not a second reasoning."""
    body = {"messages": [CONTINUED[0], {"role": "assistant", "content": "Here:"}], "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 12, "response_format": {"type": "json_object"}}
    message = chat(server, **body)["choices"][0]["message"]
    assert message.get("reasoning_content") is None, message
    assert (message["content"] or "").lstrip().startswith("{"), message


def test_continue_final_message_with_text_parts(server, tokenizer):
    messages = [CONTINUED[0], {"role": "assistant", "content": [{"type": "text", "text": "It "},
                                                                 {"type": "text", "text": "is"}]}]
    answer = chat(server, messages=messages, add_generation_prompt=False, continue_final_message=True, echo=True,
                  return_token_ids=True)
    assert tokenizer.decode(answer["prompt_token_ids"], skip_special_tokens=False).endswith("It is")
    assert answer["choices"][0]["message"]["content"].startswith("It is")


def test_chat_echo_streamed_with_n_and_token_ids(server):
    body = {"messages": CONTINUED, "echo": True, "n": 2, "temperature": 1.0, "seed": 4, "return_token_ids": True,
            "ignore_eos": True}
    whole = chat(server, **body)
    streamed = streamed_chat(server, **body)
    for choice in whole["choices"]:
        got = streamed[choice["index"]]
        assert got["content"] == choice["message"]["content"] and got["token_ids"] == choice["token_ids"]
        assert choice["message"]["content"].startswith("It is")


def test_chat_skip_special_tokens_false_keeps_them(server, tokenizer):
    start = tokenizer.token_to_id("<|im_start|>")
    body = {"logit_bias": {str(start): 100}, "max_tokens": 2, "skip_special_tokens": False,
            "chat_template_kwargs": {"enable_thinking": False}}
    answer = chat(server, **body)["choices"][0]["message"]
    assert answer["content"] == "<|im_start|>" * 2
    assert streamed_chat(server, **body)[0]["content"] == answer["content"]


def test_request_id_names_every_streamed_chunk(server):
    chunks = server.events("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 3, "request_id": "abc"})
    assert {c["id"] for c in chunks} == {"chatcmpl-abc"}
