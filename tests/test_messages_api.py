"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) against a live `serve --device cpu
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3` on a random byte-level checkpoint
carrying Qwen3's chat template, driven by the official anthropic client: the answer is the chat route's for the
same conversation (text, tool calls, thinking, usage); tool_use and tool_result blocks render as the chat's tool
calls and tool messages; the stream's events build the whole answer; errors have Anthropic's shape and name the
field; the API key is taken as x-api-key."""

import json

import anthropic
import jsonschema
import pytest

from live_server import NAME, start_tools_server, stop_server

pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"name": "get_weather", "description": "The forecast", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                                "parameters": WEATHER}}]
NO_THINKING = {"type": "disabled"}
USER = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    log = tmp_path_factory.mktemp("messages") / "serve.log"
    server = start_tools_server(checkpoint_factory("tools_bpe", seed=7), log, "--api-key", "secret")
    yield server
    stop_server(server)


def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="secret", max_retries=0, timeout=120)


def create(server, **body):
    args = dict(model=NAME, max_tokens=12, messages=USER, thinking=NO_THINKING, extra_body={"temperature": 0})
    return client(server).messages.create(**(args | body))


def streamed(server, **body):
    args = dict(model=NAME, max_tokens=12, messages=USER, thinking=NO_THINKING, extra_body={"temperature": 0})
    with client(server).messages.stream(**(args | body)) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def chat(server, **body) -> dict:
    reply = server.post("/v1/chat/completions", {"model": NAME, "max_completion_tokens": 12, "temperature": 0,
                                                 "chat_template_kwargs": {"enable_thinking": False}, **body},
                        key="secret")
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_text_answers_as_the_chat_route_does(server):
    message = create(server, system=[{"type": "text", "text": "Be brief."}])
    expected = chat(server, messages=[{"role": "system", "content": "Be brief."}, *USER])
    (block,) = message.content
    assert block.type == "text" and block.text == expected["choices"][0]["message"]["content"]
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected["usage"]["prompt_tokens"]
    counted = client(server).messages.count_tokens(model=NAME, messages=USER, system="Be brief.",
                                                   thinking=NO_THINKING)
    assert counted.input_tokens == expected["usage"]["prompt_tokens"]


def test_the_stream_builds_the_whole_answer(server):
    whole = create(server, max_tokens=16)
    events, final = streamed(server, max_tokens=16)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(final.content))) == [e.index for e in events if e.type == "content_block_stop"]


def test_any_tool_choice_gives_tool_use_blocks_whole_and_streamed(server):
    body = dict(tools=TOOLS, tool_choice={"type": "any"}, max_tokens=80, extra_body={"temperature": 1.0, "seed": 3})
    whole = create(server, **body)
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert uses and whole.stop_reason == "tool_use"
    for use in uses:
        assert use.name == "get_weather" and use.id.startswith("call_")
        jsonschema.validate(use.input, WEATHER)
    events, final = streamed(server, **body)
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                     and e.delta.type == "input_json_delta")
    assert json.loads("[" + pieces.replace("}{", "},{") + "]") == [u.input for u in uses]


def test_tool_use_and_tool_result_blocks_render_as_chat_tool_messages(server):
    messages = [USER[0], {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    counted = client(server).messages.count_tokens(model=NAME, messages=messages, tools=TOOLS,
                                                   tool_choice={"type": "none"}, thinking=NO_THINKING)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    expected = chat(server, tools=CHAT_TOOLS, tool_choice="none", messages=[
        USER[0], {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "And tomorrow?"}])
    assert counted.input_tokens == expected["usage"]["prompt_tokens"]


def test_thinking_becomes_a_thinking_block_whole_and_streamed(server):
    forced = {"temperature": 0, "structured_outputs": {"regex": "<think>\nweigh it\n</think>\n\nThe answer"}}
    whole = create(server, max_tokens=40, extra_body=forced)
    thinking, text = whole.content
    assert (thinking.type, thinking.thinking) == ("thinking", "\nweigh it\n")
    assert (text.type, text.text) == ("text", "\n\nThe answer") and whole.stop_reason == "end_turn"
    _, final = streamed(server, max_tokens=40, extra_body=forced)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    on = client(server).messages.count_tokens(model=NAME, messages=USER, thinking={"type": "enabled",
                                                                                  "budget_tokens": 1024})
    off = client(server).messages.count_tokens(model=NAME, messages=USER, thinking=NO_THINKING)
    assert off.input_tokens == chat(server, messages=USER)["usage"]["prompt_tokens"] != on.input_tokens


def test_a_stop_sequence_is_named(server):
    text = create(server).content[0].text
    stop = text[2:4]
    message = create(server, stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[:text.find(stop)]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "undeclared"}}, "tool_choice"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
    ({"mcp_servers": [{"url": "http://x"}]}, "mcp_servers"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"system": [{"type": "image"}]}, "system"),
])
def test_bad_input_is_an_anthropic_error_naming_its_field(server, body, param):
    payload = {"model": NAME, "max_tokens": 4, "messages": USER, **body}
    reply = server.post("/v1/messages", {k: v for k, v in payload.items() if v is not None}, key=None,
                        headers={"x-api-key": "secret"})
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param, error
    assert create(server, max_tokens=2).stop_reason == "max_tokens"


def test_a_wrong_key_is_refused_as_anthropic_clients_read_it(server):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=NAME, max_tokens=2, messages=USER)
