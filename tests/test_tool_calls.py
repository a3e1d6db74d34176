"""Tool calls and reasoning against a live `serve --device cpu --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3` on a random byte-level checkpoint carrying Qwen3's published chat template (with tools and
thinking), driven by the official openai client: tool_choice required and a named function give calls whose
arguments validate against their schemas over 30 seeds, finish_reason "tool_calls"; streamed tool-call deltas
assemble into the non-streamed calls; auto parses what the model wrote; reasoning is split into reasoning_content,
streamed too; and every bad tools or tool_choice is a 400 naming it while the server keeps serving."""

import json

import httpx
import jsonschema
import pytest

from live_server import NAME, start_tools_server, stop_server
from pegainfer.server.errors import ApiError
from pegainfer.server.tools import call_grammar, resolve_tool_choice

pytest.importorskip("xgrammar")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}}}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": PING}}]
SCHEMAS = {"get_weather": WEATHER, "ping": PING}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools") / "serve.log"
    server = start_tools_server(checkpoint_factory("tools_bpe", seed=7), log)
    yield server
    stop_server(server)


def create(server, **body):
    args = dict(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=160, temperature=1.0, extra_body=NO_THINKING)
    return server.client().chat.completions.create(**(args | body))


def test_required_tool_choice_gives_calls_that_validate_over_30_seeds(server):
    for seed in range(30):
        (choice,) = create(server, seed=seed, tool_choice="required").choices
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (seed, choice.message)
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_the_one_called(server):
    for seed in range(10):
        (choice,) = create(server, seed=seed, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                           ).choices
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and choice.finish_reason == "stop"  # OpenAI's, for a named one
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_streamed_tool_call_deltas_assemble_into_the_same_calls(server):
    body = dict(seed=4, tool_choice="required")
    whole = create(server, **body).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in create(server, stream=True, **body):
        for piece in chunk.choices:
            finish = piece.finish_reason or finish
            for delta in piece.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function.name:
                    assert delta.id and not entry["name"], "the name comes once, with the id, first"
                    entry["name"] = delta.function.name
                entry["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]


def test_auto_parses_what_the_model_wrote(server):
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    forced = {**NO_THINKING, "structured_outputs": {"regex": "Sure\\. " + call.replace("{", "\\{").replace(
        "}", "\\}").replace("|", "\\|")}}
    result = server.client().chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=64,
                                                     tool_choice="auto", extra_body=forced)
    (choice,) = result.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    (parsed,) = choice.message.tool_calls
    assert parsed.function.name == "ping" and json.loads(parsed.function.arguments) == {}
    plain = create(server, seed=1, max_tokens=8)  # auto over free text: no call
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_reasoning_is_split_into_reasoning_content_whole_and_streamed(server):
    forced = {**NO_THINKING, "structured_outputs": {"regex": "<think>\nweigh it\n</think>\n\nThe answer"}}
    args = dict(model=NAME, messages=MESSAGES, max_tokens=64, extra_body=forced)
    message = server.client().chat.completions.create(**args).choices[0].message
    assert message.content == "\n\nThe answer"
    assert message.model_extra["reasoning_content"] == "\nweigh it\n" == message.model_extra["reasoning"]
    reasoning = content = ""
    for chunk in server.client().chat.completions.create(**args, stream=True):
        for piece in chunk.choices:
            reasoning += (piece.delta.model_extra or {}).get("reasoning_content") or ""
            content += piece.delta.content or ""
    assert (reasoning, content) == ("\nweigh it\n", "\n\nThe answer")


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "undeclared"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": "not a list"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": None}}, "tool_choice"),
    ({"tools": TOOLS, "chat_template_kwargs": {"tools": 5}}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_a_400_naming_them_and_the_server_keeps_serving(server, body, param):
    reply = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES,
                                                                  "max_tokens": 4, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert create(server, seed=0, max_tokens=2).choices[0].finish_reason == "length"


def test_auto_needs_the_flags_and_required_needs_a_known_parser():
    with pytest.raises(ApiError, match="--enable-auto-tool-choice"):
        resolve_tool_choice(TOOLS, "auto", None, auto_enabled=False)
    assert resolve_tool_choice(None, "auto", None, auto_enabled=False).mode == "none"
    required = resolve_tool_choice(TOOLS, "required", False, auto_enabled=False)
    with pytest.raises(ApiError, match="--tool-call-parser"):
        call_grammar(required, "")
    for parser in ("hermes", "llama3_json", "mistral"):
        tag = json.loads(call_grammar(required, parser).source)["format"]
        calls = tag.get("content", tag)
        assert calls["stop_after_first"] and [t["content"]["json_schema"] for t in calls["tags"]] == [WEATHER, PING]


def test_a_thinking_request_is_constrained_only_after_its_reasoning(server):
    """Thinking on (Qwen3's default): the grammar opens <think> and leaves the reasoning free; a random model
    rarely closes it, so the short answer is all reasoning, where a grammar from the first token would be JSON."""
    result = server.client().chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=24, seed=2, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    message = result.choices[0].message
    assert message.model_extra["reasoning_content"] is not None, message


@pytest.mark.parametrize("parser, opening", [("qwen3", "<think>"), ("deepseek_r1", "")])
def test_after_reasoning_grammar_frees_the_reasoning_and_holds_the_answer(tiny_checkpoint, parser, opening):
    from pegainfer.runtime.tokenizer import load_tokenizer
    from pegainfer.server.structured import GrammarSpec, Grammars, after_reasoning

    tokenizer = load_tokenizer(tiny_checkpoint)
    vocab = json.loads((tiny_checkpoint / "config.json").read_text())["vocab_size"]
    grammars = Grammars(tokenizer, vocab)
    spec = after_reasoning(GrammarSpec("json", json.dumps(WEATHER), "response_format"), parser)

    def allowed(text: str) -> bool:
        constraint = grammars.constraint_factory(spec)()
        for token in tokenizer.encode(text):
            if not constraint.allowed(vocab)[token]:
                return False
            constraint.accept(token)
        return True
    answer = '{"city": "Oslo", "days": 3}'
    assert allowed(opening + "free text, {not json}</think>\n\n" + answer)
    assert not allowed(opening + "thinking</think>\n\nplain words")
    if opening:  # qwen3: the reasoning's tag comes first (deepseek_r1's prompt opened it: any text is reasoning)
        assert not allowed(answer)


def test_a_conversation_carries_the_calls_and_their_results_back(server):
    """The second turn of an agent loop: the assistant's tool_calls and the tool's answer, rendered by Qwen3's
    template, then a new call forced by name."""
    (first,) = create(server, seed=3, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices
    call = first.message.tool_calls[0]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "rain"}'}]
    (second,) = create(server, seed=4, messages=history, tool_choice="required").choices
    assert second.finish_reason == "tool_calls" and second.message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", [
    {"tools": TOOLS, "tool_choice": "required", "seed": 4, "max_tokens": 160},
    {"structured_outputs": {"regex": "Sure\\. <tool_call>\n\\{\"name\": \"ping\", \"arguments\": \\{\\}\\}\n"
                                     "</tool_call>"}, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 64},
    {"structured_outputs": {"regex": "<think>\nweigh it\n</think>\n\nThe answer"}, "max_tokens": 64}],
    ids=["required", "auto", "reasoning"])
def test_tool_calls_and_reasoning_match_the_published_schema(server, body, stream):
    """/openapi.json describes the answers with tool calls (content null, finish_reason "tool_calls") and
    reasoning, whole and streamed, as schemathesis reads it."""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)
    api = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operation = api["/v1/chat/completions"]["POST"]
    case = operation.Case(body={"model": NAME, "messages": MESSAGES, **NO_THINKING, **body, "stream": stream},
                          media_type="application/json")
    response = case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                              response_schema_conformance], timeout=60)
    assert ("tool_calls" in response.text) == ("tools" in body), response.text[:400]
