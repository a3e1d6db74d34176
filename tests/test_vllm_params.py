"""vLLM's own request parameters against a live `serve --device cpu` on a random byte-level checkpoint whose chat
template also writes `documents`: include_stop_str_in_output and stop_reason, a stop token's text left out,
skip_special_tokens, truncate_prompt_tokens, allowed_token_ids, return_token_ids, return_tokens_as_token_ids,
request_id, cache_salt, add_special_tokens, and chat's continue_final_message, echo and documents; whole and
streamed the same; the ones pegainfer lacks refused with a 400 naming them."""

import pytest
from tokenizers import Tokenizer

from live_server import NAME, start_server, stop_server, with_chat_template

DOCUMENTS_TEMPLATE = ("{% if documents %}{% for d in documents %}<doc>{{ d['text'] }}</doc>\n{% endfor %}{% endif %}"
                      "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    checkpoint = checkpoint_factory("vllm_params", seed=3)
    with_chat_template(checkpoint, DOCUMENTS_TEMPLATE)
    server = start_server(checkpoint, "--max-model-len", "256", log=tmp_path_factory.mktemp("params") / "serve.log")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def tokenizer(server) -> Tokenizer:
    return Tokenizer.from_file(str(server.checkpoint / "tokenizer.json"))


def complete(server, **body) -> dict:
    reply = server.post("/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def chat(server, messages: list[dict], **body) -> dict:
    reply = server.post("/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 8,
                                                 "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed_completion(server, **body) -> tuple[str, list[int], dict]:
    """The streamed text, token ids (return_token_ids) and last choice object of a completion."""
    chunks = server.events("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                               "ignore_eos": True, "return_token_ids": True, **body})
    choices = [chunk["choices"][0] for chunk in chunks]
    return "".join(c["text"] for c in choices), [t for c in choices for t in c["token_ids"]], choices[-1]


def test_a_stop_string_is_kept_with_include_stop_str_in_output_and_named_in_stop_reason(server):
    greedy = complete(server)["choices"][0]["text"]
    stop = greedy[3:6]
    cut = complete(server, stop=[stop])["choices"][0]
    kept = complete(server, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    assert cut["text"] == greedy[:greedy.find(stop)] and cut["finish_reason"] == "stop"
    assert kept["text"] == greedy[:greedy.find(stop) + len(stop)]
    assert cut["stop_reason"] == kept["stop_reason"] == stop
    text, _, last = streamed_completion(server, stop=[stop], include_stop_str_in_output=True)
    assert text == kept["text"] and last["stop_reason"] == stop and last["finish_reason"] == "stop"
    assert complete(server)["choices"][0]["stop_reason"] is None  # a length finish


def test_a_stop_tokens_text_is_left_out_unless_included(server, tokenizer):
    whole = complete(server, return_token_ids=True)["choices"][0]
    stop_id = whole["token_ids"][4]
    first = whole["token_ids"].index(stop_id)
    before = tokenizer.decode(whole["token_ids"][:first])
    cut = complete(server, stop_token_ids=[stop_id], return_token_ids=True)["choices"][0]
    assert cut["token_ids"] == whole["token_ids"][:first + 1] and cut["stop_reason"] == stop_id
    assert before.startswith(cut["text"].lstrip()) and len(cut["text"]) < len(whole["text"])
    kept = complete(server, stop_token_ids=[stop_id], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"].endswith(tokenizer.decode([stop_id])) and kept["text"].startswith(cut["text"])
    text, ids, last = streamed_completion(server, stop_token_ids=[stop_id])
    assert (text, ids, last["stop_reason"]) == (cut["text"], cut["token_ids"], stop_id)


def test_special_tokens_show_only_when_not_skipped(server, tokenizer):
    start = tokenizer.token_to_id("<|im_start|>")
    forced = {"logit_bias": {str(start): 100}, "max_tokens": 3}
    assert complete(server, **forced)["choices"][0]["text"] == ""
    assert complete(server, **forced, skip_special_tokens=False)["choices"][0]["text"] == "<|im_start|>" * 3
    text, _, _ = streamed_completion(server, **forced, skip_special_tokens=False)
    assert text == "<|im_start|>" * 3


def test_truncate_prompt_tokens_keeps_the_last_ones(server, tokenizer):
    ids = tokenizer.encode(PROMPT * 3).ids
    result = complete(server, prompt=PROMPT * 3, truncate_prompt_tokens=5, return_token_ids=True)
    assert result["choices"][0]["prompt_token_ids"] == ids[-5:] and result["usage"]["prompt_tokens"] == 5
    by_ids = complete(server, prompt=ids, truncate_prompt_tokens=5, return_token_ids=True)
    assert by_ids["choices"][0]["prompt_token_ids"] == ids[-5:]
    assert by_ids["choices"][0]["text"] == result["choices"][0]["text"]
    huge = "lorem ipsum dolor " * 20_000  # far past the context: only its end is encoded
    tail = complete(server, prompt=huge, truncate_prompt_tokens=40, return_token_ids=True)["choices"][0]
    assert tail["prompt_token_ids"] == tokenizer.encode(huge[-2000:]).ids[-40:]
    messages = [{"role": "user", "content": PROMPT}]
    assert chat(server, messages, truncate_prompt_tokens=3)["usage"]["prompt_tokens"] == 3


def test_allowed_token_ids_limit_every_draw(server):
    allowed = [40, 41, 97, 120]
    for seed in range(4):
        result = complete(server, temperature=1.0, seed=seed, allowed_token_ids=allowed, return_token_ids=True)
        assert set(result["choices"][0]["token_ids"]) <= set(allowed), seed
    _, ids, _ = streamed_completion(server, temperature=1.0, seed=9, allowed_token_ids=allowed)
    assert len(ids) == 12 and set(ids) <= set(allowed)


def test_return_tokens_as_token_ids_names_logprobs_by_id(server):
    choice = complete(server, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(key.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for key in top)
    content = chat(server, [{"role": "user", "content": PROMPT}], logprobs=True, top_logprobs=1,
                   return_tokens_as_token_ids=True, return_token_ids=True)["choices"][0]
    assert [e["token"] for e in content["logprobs"]["content"]] == [f"token_id:{t}" for t in content["token_ids"]]


def test_return_token_ids_whole_and_streamed_agree(server, tokenizer):
    whole = complete(server, return_token_ids=True)["choices"][0]
    text, ids, _ = streamed_completion(server)
    assert whole["prompt_token_ids"] == tokenizer.encode(PROMPT).ids
    assert (text, ids) == (whole["text"], whole["token_ids"]) and len(ids) == 12
    messages = [{"role": "user", "content": PROMPT}]
    answer = chat(server, messages, return_token_ids=True, ignore_eos=True)
    chunks = server.events("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True, "return_token_ids": True})
    assert chunks[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == answer["choices"][0]["token_ids"]


def test_request_id_names_the_answer_and_may_repeat(server):
    first, second = complete(server, request_id="mine"), complete(server, request_id="mine")
    assert first["id"] == second["id"] == "cmpl-mine"
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_cache_salt_keeps_prefix_hits_among_its_own(server):
    prompt = "salted " * 40
    usage = [complete(server, prompt=prompt, max_tokens=1, cache_salt=salt)["usage"]["prompt_tokens_details"]
             for salt in ("a", "a", "b")]
    assert usage[1]["cached_tokens"] > 0 and usage[2]["cached_tokens"] == 0


def test_add_special_tokens_for_completions(server, tokenizer):
    plain = complete(server, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    without = complete(server, add_special_tokens=False, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    assert plain == tokenizer.encode(PROMPT).ids and without == tokenizer.encode(PROMPT, add_special_tokens=False).ids


def test_continue_final_message_leaves_the_last_message_open(server, tokenizer):
    messages = [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "It is"}]
    answer = chat(server, messages, add_generation_prompt=False, continue_final_message=True, return_token_ids=True)
    prompt = tokenizer.decode(answer["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\nIt is")
    echoed = chat(server, messages, add_generation_prompt=False, continue_final_message=True, echo=True)
    assert echoed["choices"][0]["message"]["content"] == "It is" + answer["choices"][0]["message"]["content"]
    chunks = server.events("/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                    "add_generation_prompt": False, "continue_final_message": True,
                                                    "echo": True})
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert streamed == echoed["choices"][0]["message"]["content"]
    user_last = chat(server, messages[:1], echo=True)  # the answer's role is not the last message's: no echo
    assert not user_last["choices"][0]["message"]["content"].startswith("Say it")


def test_documents_reach_the_template(server, tokenizer):
    answer = chat(server, [{"role": "user", "content": "hi"}], documents=[{"text": "alpha"}, {"text": "beta"}],
                  return_token_ids=True)
    prompt = tokenizer.decode(answer["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.startswith("<doc>alpha</doc>\n<doc>beta</doc>\n<|im_start|>user\nhi")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"priority": 1}, "priority"),
    ("/v1/completions", {"logits_processors": ["my.Processor"]}, "logits_processors"),
    ("/v1/completions", {"length_penalty": 0.5}, "length_penalty"),
    ("/v1/completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", {"truncate_prompt_tokens": 4096}, "truncate_prompt_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/completions", {"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [5], "structured_outputs": {"choice": ["a"]}}, "allowed_token_ids"),
    ("/v1/completions", {"cache_salt": ""}, "cache_salt"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": False,
                              "messages": [{"role": "assistant", "content": " "}]}, "messages"),
])
def test_what_pegainfer_lacks_or_cannot_do_is_a_400_naming_it(server, path, body, param):
    base = {"model": NAME, "max_tokens": 2, **({"prompt": PROMPT} if "completions" == path[4:] else
                                               {"messages": [{"role": "user", "content": PROMPT}]})}
    reply = server.post(path, base | body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert complete(server, max_tokens=1)["choices"][0]["finish_reason"] == "length"


def test_tokenize_renders_chat_as_the_chat_route_does(server):
    messages = [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "It is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True,
            "documents": [{"text": "alpha"}]}
    tokens = server.post("/tokenize", {"model": NAME, **body}).json()["tokens"]
    assert tokens == chat(server, **body, return_token_ids=True)["prompt_token_ids"]
    both = server.post("/tokenize", {"model": NAME, **body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_continuous_usage_stats_count_as_tokens_come(server):
    chunks = server.events("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                               "ignore_eos": True, "return_token_ids": True,
                                               "stream_options": {"include_usage": True,
                                                                  "continuous_usage_stats": True}})
    counted = [chunk["usage"]["completion_tokens"] for chunk in chunks if chunk["choices"]]
    assert counted == list(range(1, 7)) and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(chunk["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for chunk in chunks)
