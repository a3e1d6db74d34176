"""Edge cases of Anthropic's Messages API (POST /v1/messages) as real clients drive it: the anthropic client's
stream accumulation, agent loops (tool_use / tool_result / thinking blocks fed back, assistant prefill), tool_choice
forms, and bad input answered with a 400 in Anthropic's shape naming its field, never a 500."""

import json
import re

import anthropic
import httpx
import pytest

from live_server import NAME
from test_messages_api import (CHAT_TOOLS, NO_THINKING, TOOLS, USER, WEATHER, chat, client, create,  # noqa: F401
                               server, streamed)

pytest.importorskip("xgrammar")

def raw_events(server, body: dict) -> list[dict]:
    """The stream's events as sent (data of each SSE event), checked against their event: lines."""
    payload = {"model": NAME, "max_tokens": 12, "messages": USER, "thinking": NO_THINKING, "temperature": 0,
               "stream": True, **body}
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", json=payload, headers={"x-api-key": "secret"},
                      timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        name = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name
                events.append(event)
    return events


def count(server, **body) -> int:
    args = dict(model=NAME, messages=USER, thinking=NO_THINKING)
    return client(server).messages.count_tokens(**(args | body)).input_tokens


def test_an_assistant_prefill_is_continued(server):
    """A last assistant message is the start of the answer (Anthropic's prefill; SGLang continues it too), not a
    finished turn followed by a new one: the prompt is the chat route's continue_final_message prompt."""
    messages = [*USER, {"role": "assistant", "content": "The weather is"}]
    expected = chat(server, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert count(server, messages=messages) == expected["usage"]["prompt_tokens"]
    message = create(server, messages=messages)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected["usage"]["prompt_tokens"]
    assert message.content[0].text == expected["choices"][0]["message"]["content"]


def test_whitespace_after_the_thinking_is_not_thinking(server):
    """A thinking model's "\\n\\n" after </think>, with nothing after it, is no part of the thinking block."""
    forced = {"temperature": 0, "structured_outputs": {"regex": "<think>\nweigh it\n</think>\n\n"}}
    whole = create(server, max_tokens=40, extra_body=forced)
    thinking = [b for b in whole.content if b.type == "thinking"]
    assert [b.thinking for b in thinking] == ["\nweigh it\n"], whole.content
    _, final = streamed(server, max_tokens=40, extra_body=forced)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]


def test_message_start_usage_agrees_with_the_final_usage(server):
    """message_start's input_tokens are the ones the answer reports (a prefix-cache hit counted once, as
    cache_read_input_tokens, in both), so a client reading either gets one number."""
    body = {"messages": [{"role": "user", "content": "a shared prefix " * 20}]}
    raw_events(server, body)  # warms the prefix cache
    events = raw_events(server, body)
    start = events[0]["message"]["usage"]
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert start["input_tokens"] == delta["usage"]["input_tokens"], (start, delta["usage"])


def test_the_stream_has_anthropics_event_shapes(server):
    events = raw_events(server, {})
    assert [e["type"] for e in events][:1] == ["message_start"] and events[-1] == {"type": "message_stop"}
    message = events[0]["message"]
    assert message["content"] == [] and message["stop_reason"] is None and message["role"] == "assistant"
    (delta,) = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 12


def test_a_named_tool_choice_ends_with_tool_use(server):
    body = dict(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=80,
                extra_body={"temperature": 1.0, "seed": 3})
    whole = create(server, **body)
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert use.name == "get_weather" and whole.stop_reason == "tool_use"
    _, final = streamed(server, **body)
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]


def test_disable_parallel_tool_use_gives_one_call(server):
    body = dict(tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=120,
                extra_body={"temperature": 1.0, "seed": 3})
    whole = create(server, **body)
    assert len([b for b in whole.content if b.type == "tool_use"]) == 1 and whole.stop_reason == "tool_use"


def test_an_agent_loop_turn_renders_as_the_chat_route_does(server):
    """What Claude Code sends back: system blocks with cache_control, an assistant turn of thinking (signed),
    text and parallel tool_use blocks, then tool_result blocks (one is_error) with cache_control, metadata."""
    messages = [USER[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should look.", "signature": "c2ln"},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "rain"}],
             "cache_control": {"type": "ephemeral"}}]}]
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    calls = [{"id": f"toolu_{i}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
             for i, city in ((1, "Paris"), (2, "Rome"))]
    expected = chat(server, tools=CHAT_TOOLS, chat_template_kwargs={"enable_thinking": True}, messages=[
        {"role": "system", "content": "You are terse."}, USER[0],
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I should look.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "rain"}])
    counted = count(server, messages=messages, system=system, tools=TOOLS,
                    thinking={"type": "enabled", "budget_tokens": 1024})
    assert counted == expected["usage"]["prompt_tokens"]
    message = create(server, messages=messages, system=system, tools=TOOLS, metadata={"user_id": "u1"},
                     thinking={"type": "enabled", "budget_tokens": 1024}, stop_sequences=["\n\n\n\n"],
                     extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 1})
    assert message.stop_reason in ("max_tokens", "end_turn", "tool_use", "stop_sequence")


def test_an_error_tool_result_tells_the_model(server):
    """is_error: true is what tells the model that its call failed; the prompt must differ from a success's."""
    def turn(is_error: bool) -> list:
        return [USER[0], {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout",
                                          "is_error": is_error}]}]
    assert count(server, messages=turn(True), tools=TOOLS) != count(server, messages=turn(False), tools=TOOLS)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"input_schema": WEATHER}]}, "tools"),
    ({"tools": [{"name": "f", "input_schema": "not a schema"}]}, "tools"),
    ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
    ({"stop_sequences": "stop"}, "stop_sequences"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"messages": ["hi"]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image", "source": {}}]}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                             "input": "not an object"}]}]}, "messages"),
    ({"system": [{"type": "text", "text": 3}]}, "system"),
    ({"system": 3}, "system"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": "on"}, "thinking"),
    ({"metadata": "x"}, "metadata"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"container": "c"}, "container"),
])
def test_bad_input_is_a_400_naming_its_field(server, body, param):
    payload = {"model": NAME, "max_tokens": 4, "messages": USER, **body}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        reply = server.post(path, payload, key=None, headers={"x-api-key": "secret"})
        assert reply.status_code == 400, (path, reply.text)
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["param"].split("[")[0] == param, (path, error)


def test_the_client_raises_its_bad_request_error(server):
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(server, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert caught.value.body["type"] == "error"


CALL = re.escape('<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>')


@pytest.mark.parametrize("regex, kinds", [
    ("Let me look\\.\n\n" + CALL % "Paris" + "\n" + CALL % "Rome", ["text", "tool_use", "tool_use"]),
    ("<think>\nhm\n</think>\n\n" + CALL % "Paris", ["thinking", "tool_use"]),
    (CALL % "Paris" + "\n", ["tool_use"]),
])
def test_auto_tool_calls_as_blocks_whole_and_streamed(server, regex, kinds):
    forced = {"temperature": 0, "structured_outputs": {"regex": regex}}
    body = dict(tools=TOOLS, max_tokens=400, extra_body=forced)
    whole = create(server, **body)
    assert [b.type for b in whole.content] == kinds and whole.stop_reason == "tool_use", whole.content
    assert all(b.input["city"] in ("Paris", "Rome") for b in whole.content if b.type == "tool_use")
    events, final = streamed(server, **body)
    assert [b.model_dump(exclude={"id"}) for b in final.content] == \
        [b.model_dump(exclude={"id"}) for b in whole.content]
    assert final.stop_reason == "tool_use"
    raw = raw_events(server, {"tools": TOOLS, "max_tokens": 400, **forced})
    for event in raw:
        if event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
            assert event["content_block"]["input"] == {}
    deltas = {e["index"]: e["delta"]["type"] for e in raw if e["type"] == "content_block_delta"}
    starts = {e["index"]: e["content_block"]["type"] for e in raw if e["type"] == "content_block_start"}
    expected = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}
    assert all(expected[starts[index]] == kind for index, kind in deltas.items())


def test_a_streamed_stop_sequence_is_named(server):
    text = create(server).content[0].text
    stop = text[2:4]
    _, final = streamed(server, stop_sequences=[stop])
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == text[:text.find(stop)]


def test_count_tokens_counts_a_prompt_that_fills_the_context(server):
    """count_tokens asks how long a prompt is; it sends no max_tokens, so a refusal may not name max_tokens."""
    messages = [{"role": "user", "content": "word " * 4000}]
    reply = server.post("/v1/messages/count_tokens", {"model": NAME, "messages": messages}, key="secret")
    assert reply.status_code == 200 or reply.json()["error"]["param"] != "max_tokens", reply.text


def test_disable_parallel_tool_use_holds_with_auto_choice(server):
    """disable_parallel_tool_use: at most one tool_use block, whatever tool_choice (auto here, the model writing
    two calls)."""
    forced = {"temperature": 0, "structured_outputs": {"regex": CALL % "Paris" + "\n" + CALL % "Rome"}}
    body = dict(tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True}, max_tokens=400,
                extra_body=forced)
    whole = create(server, **body)
    assert len([b for b in whole.content if b.type == "tool_use"]) == 1, whole.content
    _, final = streamed(server, **body)
    assert len([b for b in final.content if b.type == "tool_use"]) == 1, final.content


def test_text_blocks_are_not_glued_together(server):
    """Two text blocks (Claude Code's system prompt comes as several) are two pieces of text: their words are not
    run together as one string's would be."""
    glued = count(server, system="You are a helpful assistant." + "Answer in French.")
    assert count(server, system=[{"type": "text", "text": "You are a helpful assistant."},
                                 {"type": "text", "text": "Answer in French."}]) != glued
    user = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    assert count(server, messages=user) != count(server, messages=[{"role": "user", "content": "Helloworld"}])
