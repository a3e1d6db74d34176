"""POST /v1/responses against a live `serve --device cpu --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3` on a random byte-level checkpoint carrying Qwen3's chat template, driven by the official
openai client: the answer is the chat route's for the same conversation (text, tool calls, reasoning, usage);
function calls and their outputs in the input render as the chat's tool calls and tool messages; text.format and
reasoning.effort reach the grammar and the template; the stream's events build the whole answer's items; what
pegainfer does not do is a 400 naming it."""

import json

import httpx
import jsonschema
import pytest

from live_server import NAME, start_tools_server, stop_server

pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                                "parameters": WEATHER}}]
NO_THINKING = {"reasoning": {"effort": "none"}}


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "serve.log"
    server = start_tools_server(checkpoint_factory("tools_bpe", seed=7), log)
    yield server
    stop_server(server)


def respond(server, **body):
    args = dict(model=NAME, max_output_tokens=12, temperature=0) | NO_THINKING
    return server.client().responses.create(**(args | body))


def chat(server, **body) -> dict:
    reply = server.post("/v1/chat/completions", {"model": NAME, "max_completion_tokens": 12, "temperature": 0,
                                                 "chat_template_kwargs": {"enable_thinking": False}, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed(server, **body):
    """The events of a stream and its final response."""
    args = dict(model=NAME, max_output_tokens=12, temperature=0) | NO_THINKING
    with server.client().responses.stream(**(args | body)) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def test_text_input_answers_as_the_chat_route_does(server):
    result = respond(server, input="What is the weather?", instructions="Be brief.")
    expected = chat(server, messages=[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "What is the weather?"}])
    assert result.output_text == expected["choices"][0]["message"]["content"]
    assert result.status == "incomplete" and result.incomplete_details.reason == "max_output_tokens"
    assert result.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert result.usage.output_tokens == 12 and result.id.startswith("resp_") and result.store is False
    (item,) = result.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"


def test_the_stream_builds_the_whole_answers_items(server):
    whole = respond(server, input="Tell me a story")
    events, final = streamed(server, input="Tell me a story")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [e.item.id for e in events if e.type == "response.output_item.done"] == \
        [item.id for item in final.output]


def test_required_tools_give_function_calls_whole_and_streamed(server):
    body = dict(input="Weather in Paris?", tools=TOOLS, tool_choice="required", temperature=1.0,
                max_output_tokens=80, extra_body={"seed": 3})
    whole = respond(server, **body)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    events, final = streamed(server, **body)
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert pieces == "".join(c.arguments for c in calls)


def test_function_calls_and_outputs_in_the_input_render_as_chat_tool_messages(server):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    result = respond(server, input=items, tools=TOOLS, tool_choice="none")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    expected = chat(server, tools=CHAT_TOOLS, tool_choice="none", messages=[
        items[0], {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert result.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert result.output_text == expected["choices"][0]["message"]["content"]


def test_reasoning_becomes_a_reasoning_item_whole_and_streamed(server):
    forced = {"structured_outputs": {"regex": "<think>\nweigh it\n</think>\n\nThe answer"}}
    body = dict(input="Why?", max_output_tokens=40, extra_body=forced)  # thinking off: the regex writes it
    whole = respond(server, **body)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nweigh it\n"
    assert message.type == "message" and whole.output_text == "\n\nThe answer"
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    events, final = streamed(server, **body)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "\nweigh it\n"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == whole.output_text


def test_text_format_and_reasoning_effort_reach_the_grammar_and_the_template(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    result = respond(server, input="A number", max_output_tokens=60, temperature=1.0, extra_body={"seed": 2},
                     text={"format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(result.output_text), schema)
    thinking = respond(server, input="A number", reasoning={"effort": "medium"})
    off = respond(server, input="A number")
    expected_off = chat(server, messages=[{"role": "user", "content": "A number"}])
    assert off.usage.input_tokens == expected_off["usage"]["prompt_tokens"] != thinking.usage.input_tokens


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": 5, "arguments": "{}"}]}, "input"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "undeclared"}}, "tool_choice"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
])
def test_what_pegainfer_does_not_do_is_a_400_naming_it(server, body, param):
    reply = server.post("/v1/responses", {"model": NAME, "input": "hi", **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert respond(server, input="hi", max_output_tokens=2).status == "incomplete"


def test_a_raw_stream_names_each_event_in_its_event_field(server):
    reply = httpx.post(server.url + "/v1/responses", json={"model": NAME, "input": "hi", "stream": True,
                                                           "max_output_tokens": 3}, timeout=60)
    kinds = [line.split(": ", 1)[1] for line in reply.text.splitlines() if line.startswith("event: ")]
    assert reply.status_code == 200 and kinds[0] == "response.created" and kinds[-1] == "response.completed"
