"""Edge probes of POST /v1/responses (a reviewer's): agent loops that feed a response's items back, the stream's
events against the whole answer and the official client's accumulator, values the SDKs send, and bad inputs that
must be a 400 naming a field (never a 500: stop_server checks the log for tracebacks)."""


import httpx
import pytest

from live_server import NAME
from test_responses_api import CHAT_TOOLS, TOOLS, respond, server, streamed  # noqa: F401  (server: a fixture)

pytest.importorskip("xgrammar")

TOOLS = [tool | {"strict": True} for tool in TOOLS]
CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "B"}}\n</tool_call>'


def prompt_tokens_of_chat(server, **body) -> int:
    reply = server.post("/v1/chat/completions", {"model": NAME, "max_completion_tokens": 1, "temperature": 0,
                                                 "chat_template_kwargs": {"enable_thinking": False}, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens"]


def forced(text: str) -> dict:
    """Request fields making the model write `text` exactly (thinking off; tool_choice auto: the parsers split it)."""
    regex = "".join("\\" + c if c in "()[]{}?*+-|^$\\." else c for c in text)
    return dict(input="Weather?", tools=TOOLS, max_output_tokens=400,
                extra_body={"structured_outputs": {"regex": regex}})


def as_input(item) -> dict:
    """An output item fed back as the Agents SDK does (to_input_item: model_dump(exclude_unset=True))."""
    return item.model_dump(exclude_unset=True)


# --- agent loops: a response's items fed back -------------------------------------------------------------------

def test_parallel_calls_and_their_outputs_render_as_one_assistant_turn(server):
    items = [{"role": "user", "content": "Weather in A and B?"},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "A"}', "status": "completed"},
             {"type": "function_call", "id": "fc_2", "call_id": "call_2", "name": "get_weather",
              "arguments": '{"city": "B"}', "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]}]
    result = respond(server, input=items, tools=TOOLS, max_output_tokens=1)
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": a}}
             for i, a in ((1, '{"city": "A"}'), (2, '{"city": "B"}'))]
    assert result.usage.input_tokens == prompt_tokens_of_chat(server, tools=CHAT_TOOLS, messages=[
        items[0], {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}])


def test_a_message_then_its_calls_render_as_one_assistant_message(server):
    """OpenAI's output for one turn is [reasoning?, message, function_call...]: fed back, it is the one assistant
    message (content and tool calls) the chat route answers, not two assistant turns."""
    items = [{"role": "user", "content": "Weather in A?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
              "content": [{"type": "reasoning_text", "text": "look it up"}]},
             {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "A"}', "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    result = respond(server, input=items, tools=TOOLS, max_output_tokens=1)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "A"}'}}
    assert result.usage.input_tokens == prompt_tokens_of_chat(server, tools=CHAT_TOOLS, messages=[
        items[0], {"role": "assistant", "content": "Let me check.", "reasoning_content": "look it up",
                   "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])


def test_a_responses_own_output_fed_back_is_the_chat_turn_it_was(server):
    """Reasoning and a call, made by the model, fed back as the Agents SDK feeds them (ids, status, summary)."""
    body = forced("<think>\nhmm\n</think>\n\n" + CALL_A)
    first = respond(server, **body)  # Qwen3's "</think>\n\n" before the call: a message item of "\n\n"
    (call,) = [item for item in first.output if item.type == "function_call"]
    content = "".join(item.content[0].text for item in first.output if item.type == "message")
    items = [{"role": "user", "content": "Weather?"}, *map(as_input, first.output),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = respond(server, input=items, tools=TOOLS, max_output_tokens=1)
    chat_call = {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
    assert second.usage.input_tokens == prompt_tokens_of_chat(server, tools=CHAT_TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content, "reasoning_content": "\nhmm\n", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])


def test_an_easy_assistant_message_and_refusal_parts_are_taken(server):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
             {"type": "message", "role": "developer", "content": "be brief"},
             {"role": "user", "content": "again"}]
    result = respond(server, input=items, max_output_tokens=1)
    assert result.usage.input_tokens == prompt_tokens_of_chat(server, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"},
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "again"}])


# --- the stream against the whole answer ------------------------------------------------------------------------

def check_events(events):
    """Sequence numbers, item ids, output and content indexes consistent, as OpenAI streams them."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    open_items: dict[int, str] = {}
    for event in events:
        if event.type == "response.output_item.added":
            assert event.output_index not in open_items
            open_items[event.output_index] = event.item.id
        elif hasattr(event, "item_id"):
            assert open_items[event.output_index] == event.item_id, event
    assert sorted(open_items) == list(range(len(open_items)))


def test_parallel_calls_stream_as_the_whole_answer_lists_them(server):
    body = forced(CALL_A + "\n" + CALL_B)
    whole = respond(server, **body)
    events, final = streamed(server, **body)
    check_events(events)
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == \
        [(i.type, getattr(i, "arguments", None)) for i in whole.output]
    assert [i.type for i in whole.output] == ["function_call", "function_call"]


def test_text_after_a_call_streams_in_the_whole_answers_order(server):
    body = forced("Checking. " + CALL_A + " done")
    whole = respond(server, **body)
    events, final = streamed(server, **body)
    check_events(events)
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    assert final.output_text == whole.output_text


def test_an_empty_answer_streams_the_whole_answers_items(server):
    text = respond(server, input="Tell me a story").output_text
    body = dict(input="Tell me a story", extra_body={"stop": [text[0]]})
    whole = respond(server, **body)
    assert whole.output_text == "" and whole.status == "completed"
    events, final = streamed(server, **body)
    assert [i.type for i in final.output] == [i.type for i in whole.output]


def test_an_incomplete_answer_says_so_in_its_items(server):
    """max_output_tokens cut the message: OpenAI marks the item incomplete, as the response is."""
    whole = respond(server, input="Tell me a story", max_output_tokens=3)
    assert whole.status == "incomplete"
    assert whole.output[-1].status == "incomplete"


# --- what the SDKs send -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {"store": False, "include": ["reasoning.encrypted_content"], "truncation": "disabled", "metadata": {"k": "v"},
     "parallel_tool_calls": False, "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u1",
     "top_logprobs": 0, "user": "u", "stream_options": {"include_obfuscation": False}, "background": False,
     "max_tool_calls": None, "prompt": None, "previous_response_id": None, "text": {"verbosity": "medium"}},
    {"reasoning": {"effort": "xhigh", "summary": "auto"}},
    {"reasoning": {"effort": "max"}},
    {"reasoning": {"effort": None, "summary": "detailed"}},
    {"tool_choice": "auto"},  # without tools
    {"tools": None},
    {"tool_choice": None, "text": None, "reasoning": None, "include": None, "metadata": None, "truncation": None},
])
def test_what_sdks_send_is_taken(server, body):
    reply = server.post("/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 2, **body})
    assert reply.status_code == 200, reply.text
    assert reply.json()["object"] == "response"


def test_truncation_auto_drops_the_start_of_a_long_input(server):
    """OpenAI's truncation auto: an input past the context window loses its first turns, and the answer runs;
    one message past it alone is still a 400, and so is any past it with truncation disabled."""
    turns = [{"role": role, "content": " ".join(f"w{t}x{i}" for i in range(300))}
             for t in range(8) for role in ("user", "assistant")][:-1]
    body = {"model": NAME, "input": turns, "max_output_tokens": 4}
    assert server.post("/v1/responses", body).status_code == 400
    reply = server.post("/v1/responses", body | {"truncation": "auto"})
    assert reply.status_code == 200, reply.text
    assert 0 < reply.json()["usage"]["input_tokens"] <= 2048 - 4
    alone = server.post("/v1/responses", body | {"truncation": "auto", "input": [turns[0] | {"content": "w " * 3000}]})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "input", alone.text


# --- bad input: a 400 naming a field ----------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({"input": ["hi"]}, "input"),
    ({"input": [{"role": "user"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
    ({"input": [{"role": "user", "content": ["hi"]}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input"),
    ({"input": [{"type": "reasoning", "content": "x"}, {"role": "user", "content": "hi"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]},
                {"role": "assistant", "content": "x"}]}, "input"),
    ({"input": [{"type": "reasoning", "content": 5}, {"role": "assistant", "content": "x"}]}, "input"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                      "tools": [{"type": "function", "name": "get_weather"}]}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "nope"}}}, "text"),
    ({"text": "json"}, "text"),
    ({"reasoning": {"effort": 5}}, "reasoning"),
    ({"reasoning": "high"}, "reasoning"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"top_logprobs": 99}, "top_logprobs"),
    ({"temperature": 3}, "temperature"),
])
def test_bad_input_is_a_400_naming_its_field(server, body, param):
    reply = server.post("/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 2, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()


def test_a_bad_streamed_request_is_a_400_not_an_event(server):
    reply = httpx.post(server.url + "/v1/responses", json={"model": NAME, "input": [], "stream": True}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
