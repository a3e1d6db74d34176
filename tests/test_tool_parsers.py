"""The tool-call parsers: parse gives the hand-written result for each scripted text, and streaming the text cut
anywhere (every split in two, one character at a time, seeded random chunkings) assembles, as an OpenAI client
assembles chunks, to exactly what parse gives; a seeded fuzz holds the two together on texts nobody wrote."""

import random
import re

import pytest

from chunkings import chunkings, random_chunkings
from pegainfer.server.tool_parsers import (
    TOOL_PARSERS, Delta, ParsedOutput, ToolCall, assemble, random_call_id, seeded_call_ids, tool_parser)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
NESTED_IN = '{"name":"query","arguments":{"filter":{"range":{"lo":1,"hi":[2,3]}},"flag":true,"none":null}}'
NESTED_OUT = '{"filter": {"range": {"lo": 1, "hi": [2, 3]}}, "flag": true, "none": null}'
UNICODE_IN = '{"name": "say", "arguments": {"text": "She said \\"h\\u00e9llo\\" \u2014 \u4f60\u597d"}}'
UNICODE_OUT = '{"text": "She said \\"h\u00e9llo\\" \u2014 \u4f60\u597d"}'
PARIS = ("get_weather", '{"city": "Paris"}')

# (parser, text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", "Hello, world.", "Hello, world.", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [PARIS]),
    ("hermes", f'<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n'
     "</tool_call>", None, [PARIS, ("get_time", "{}")]),
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.\n", [PARIS]),
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>\n\nDone.", "Done.", [PARIS]),
    ("hermes", 'Sure <tool_call>{"name": "f", "arguments": {oops}}</tool_call> ok',
     'Sure <tool_call>{"name": "f", "arguments": {oops}}</tool_call> ok', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", f"<tool_call>{NESTED_IN}</tool_call>", None, [("query", NESTED_OUT)]),
    ("hermes", f"<tool_call>{UNICODE_IN}</tool_call>", None, [("say", UNICODE_OUT)]),
    ("hermes", "Answer: 42 <tool_ca", "Answer: 42 <tool_ca", []),
    ("hermes", f"<tool_call>{WEATHER}</tool_", f"<tool_call>{WEATHER}</tool_", []),
    ("hermes", f"<tool_call>\n{WEATHER}\n", None, [PARIS]),  # left open at the end, as vLLM takes it
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),
    ("llama3_json", "The capital is Paris.", "The capital is Paris.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}', None, [("search", '{"q": "x"}')]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}', None,
     [("a", "{}"), ("b", '{"n": 2}')]),
    ("llama3_json", f"I will call {WEATHER}", f"I will call {WEATHER}", []),
    ("llama3_json", '{"name": "a", "parameters": {}}\nThat is all.', "That is all.", [("a", "{}")]),
    ("llama3_json", '{"name": "a", "parameters": {oops}}', '{"name": "a", "parameters": {oops}}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"oops"}', '{"oops"}', [("a", "{}")]),
    ("llama3_json", '{"name": "a", "parameters": {}} ;; b', "; b", [("a", "{}")]),
    ("llama3_json", '<|python_tag|> {"answer": 1}', '<|python_tag|> {"answer": 1}', []),
    ("llama3_json", NESTED_IN, None, [("query", NESTED_OUT)]),
    ("llama3_json", UNICODE_IN, None, [("say", UNICODE_OUT)]),
    ("llama3_json", "<|python_", "<|python_", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1', '{"name": "a", "parameters": {"x": 1', []),
    ("mistral", "Plain answer.", "Plain answer.", []),
    ("mistral", f"[TOOL_CALLS][{WEATHER}]", None, [PARIS]),
    ("mistral", f'[TOOL_CALLS] [{WEATHER}, {{"name": "get_time", "arguments": {{"tz": "UTC"}}}}]', None,
     [PARIS, ("get_time", '{"tz": "UTC"}')]),
    ("mistral", f"Checking. [TOOL_CALLS][{WEATHER}]", "Checking. ", [PARIS]),
    ("mistral", f"[TOOL_CALLS]{WEATHER}\n", None, [PARIS]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {oops}}]', '[TOOL_CALLS][{"name": "f", "arguments": {oops}}]',
     []),
    ("mistral", "[TOOL_CALLS][1, 2] tail", "[TOOL_CALLS][1, 2] tail", []),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("mistral", f"[TOOL_CALLS] so: [TOOL_CALLS][{WEATHER}]", "[TOOL_CALLS] so: ", [PARIS]),
    ("mistral", f"[TOOL_CALLS][{NESTED_IN}]", None, [("query", NESTED_OUT)]),
    ("mistral", f"[TOOL_CALLS][{UNICODE_IN}]", None, [("say", UNICODE_OUT)]),
    ("mistral", "Done [TOOL_CA", "Done [TOOL_CA", []),
    ("mistral", f"[TOOL_CALLS][{WEATHER}", f"[TOOL_CALLS][{WEATHER}", []),
]
MAX_CUTS = 8  # random chunkings cut a text into up to 9 pieces
CASE_IDS = [f"{name}-{number}" for number, (name, *_) in enumerate(CASES)]


def client_assembly(deltas: list[Delta]) -> ParsedOutput:
    """Join the deltas from their wire form as an OpenAI client does, checking the shape of each on the way."""
    content, calls = "", {}
    for delta in deltas:
        wire = delta.as_openai()
        if "content" in wire:
            assert wire["content"], "an empty content delta"
            content += wire["content"]
            continue
        [entry] = wire["tool_calls"]
        if "id" in entry:  # the header of a new call
            assert entry["index"] == len(calls) and entry["type"] == "function"
            assert entry["function"]["arguments"] == "" and entry["function"]["name"]
            calls[entry["index"]] = [entry["id"], entry["function"]["name"], ""]
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            calls[entry["index"]][2] += entry["function"]["arguments"]
    return ParsedOutput(content or None, [ToolCall(*call) for call in calls.values()])


def streamed(name: str, pieces: list[str]) -> ParsedOutput:
    stream = tool_parser(name, seeded_call_ids(7)).stream()
    return client_assembly([delta for piece in pieces for delta in stream.feed(piece)] + stream.finish())


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES, ids=CASE_IDS)
def test_parse_gives_the_written_result(name: str, text: str, content: str | None, calls: list[tuple[str, str]]):
    parsed = tool_parser(name).parse(text)
    assert (parsed.content, [(call.name, call.arguments) for call in parsed.tool_calls]) == (content, calls)


@pytest.mark.parametrize(("name", "text"), [(name, text) for name, text, *_ in CASES], ids=CASE_IDS)
def test_streaming_cut_anywhere_assembles_to_the_parse(name: str, text: str):
    expected = tool_parser(name, seeded_call_ids(7)).parse(text)
    for pieces in chunkings(text, MAX_CUTS):
        assert streamed(name, pieces) == expected, pieces


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "</tool", "[TOOL_CALLS]", "[TOOL_", "<|python_tag|>", "<|py",
             WEATHER, '{"name": "g"}', '{"name": "h", "parameters": {"k": [1, {"m": "}"}]}}', "{oops", "{", "}",
             "[", "]", ";", "; ", '"', "\n", " ", "Hi", "\u00e9\u4f60", "\\"]
WHOLE_CALLS = {"hermes": f"<tool_call>{WEATHER}</tool_call>", "mistral": f"[TOOL_CALLS][{WEATHER}]",
               "llama3_json": '{"name": "a", "parameters": {}}'}  # drawn often, so that many texts hold calls


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_streaming_matches_parse_on_random_texts(name: str):
    rng, with_calls, pool = random.Random(name), 0, FRAGMENTS + [WHOLE_CALLS[name]] * 6
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 10)))
        expected = tool_parser(name, seeded_call_ids(7)).parse(text)
        with_calls += bool(expected.tool_calls)
        for pieces in [list(text), *random_chunkings(text, range(3), MAX_CUTS)]:
            assert streamed(name, pieces) == expected, pieces
    assert with_calls > 20, f"the random texts must hold calls to test them, {with_calls} did"


def test_the_stream_holds_back_what_could_begin_a_tag():
    stream = tool_parser("hermes").stream()
    assert stream.feed("Hello <tool_c") == [Delta(content="Hello ")]
    assert stream.feed("a") == [] and stream.finish() == [Delta(content="<tool_ca")]
    stream = tool_parser("mistral").stream()
    assert stream.feed("ok [TOOL") == [Delta(content="ok ")] and stream.feed("S]") == [Delta(content="[TOOLS]")]


def test_a_call_streams_as_its_header_then_its_arguments():
    stream = tool_parser("hermes", seeded_call_ids(1)).stream()
    deltas = stream.feed(f"<tool_call>{WEATHER}</tool_call>") + stream.finish()
    [call_id] = {delta.id for delta in deltas if delta.id}
    assert [delta.as_openai() for delta in deltas] == [
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}]


def test_assemble_joins_deltas_as_a_client_does():
    stream = tool_parser("llama3_json", seeded_call_ids(2)).stream()
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}\nbye'
    deltas = [delta for char in text for delta in stream.feed(char)] + stream.finish()
    assert assemble(deltas) == client_assembly(deltas) == tool_parser("llama3_json", seeded_call_ids(2)).parse(text)


def test_call_ids_are_openai_shaped_and_seeded_ones_repeat():
    ids = {random_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call_id) for call_id in ids)
    first, again = seeded_call_ids(3), seeded_call_ids(3)
    assert [first(), first()] == [again(), again()] and re.fullmatch(r"call_[A-Za-z0-9]{24}", first())
    parsed = tool_parser("hermes").parse(f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>")
    assert len({call.id for call in parsed.tool_calls}) == 2


def test_a_finished_stream_refuses_more_text():
    stream = tool_parser("mistral").stream()
    stream.finish()
    with pytest.raises(RuntimeError, match="after"):
        stream.feed("x")


def test_an_unknown_parser_name_lists_the_known_ones():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, got 'pythonic'"):
        tool_parser("pythonic")
