"""The reasoning parsers: parse gives the hand-written split for each scripted text; streaming it cut anywhere (every
split in two, one character at a time, seeded random chunkings) assembles to exactly that split; and the stream's
ended and content_start() agree with it on every prefix."""

import random

import pytest

from chunkings import chunkings, random_chunkings
from pegainfer.server.reasoning import (
    REASONING_PARSERS, ReasoningDelta, ReasoningOutput, assemble, reasoning_parser)

# (parser, text, expected reasoning, expected content)
CASES = [
    ("qwen3", "Hello there.", None, "Hello there."),
    ("qwen3", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "\nLet me think.\n", "\n\nThe answer is 4."),
    ("qwen3", "\n <think>a</think>b", "a", "b"),
    ("qwen3", "<think>still thinking", "still thinking", None),
    ("qwen3", "abc</think>def", None, "abc</think>def"),
    ("qwen3", "Hi <think>x</think>y", None, "Hi <think>x</think>y"),
    ("qwen3", "<think>abc</thi", "abc</thi", None),
    ("qwen3", " <thi", None, " <thi"),
    ("qwen3", "<think>\u601d\u8003 \u201cquotes\u201d \\\"</think>\u7b54\u6848 \u00e9",
     "\u601d\u8003 \u201cquotes\u201d \\\"", "\u7b54\u6848 \u00e9"),
    ("qwen3", "<think></think>Hi", None, "Hi"),
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", "", None, None),
    ("deepseek_r1", "reasoning here</think>The answer.", "reasoning here", "The answer."),
    ("deepseek_r1", "  <think>r</think>a", "r", "a"),
    ("deepseek_r1", "all of it is reasoning", "all of it is reasoning", None),
    ("deepseek_r1", " lead</think>", " lead", None),
    ("deepseek_r1", "Hi <think>x</think>y", "Hi <think>x", "y"),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "r</th", "r</th", None),
    ("deepseek_r1", "\u601d\u8003</think>\u7b54\u6848", "\u601d\u8003", "\u7b54\u6848"),
    ("deepseek_r1", "</think>only content", None, "only content"),
    ("deepseek_r1", "", None, None),
]
MAX_CUTS = 6  # random chunkings cut a text into up to 7 pieces
CASE_IDS = [f"{name}-{number}" for number, (name, *_) in enumerate(CASES)]


def streamed(name: str, pieces: list[str]) -> ReasoningOutput:
    stream = reasoning_parser(name).stream()
    deltas = [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()
    assert all((delta.reasoning is None) != (delta.content is None) for delta in deltas), deltas
    assert all(delta.reasoning or delta.content for delta in deltas), "an empty delta"
    return assemble(deltas)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES, ids=CASE_IDS)
def test_parse_gives_the_written_split(name: str, text: str, reasoning: str | None, content: str | None):
    assert reasoning_parser(name).parse(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text"), [(name, text) for name, text, *_ in CASES], ids=CASE_IDS)
def test_streaming_cut_anywhere_assembles_to_the_parse(name: str, text: str):
    expected = reasoning_parser(name).parse(text)
    for pieces in chunkings(text, MAX_CUTS):
        assert streamed(name, pieces) == expected, pieces


@pytest.mark.parametrize(("name", "text"), [(name, text) for name, text, *_ in CASES], ids=CASE_IDS)
def test_the_end_of_reasoning_is_seen_where_the_content_begins(name: str, text: str):
    parser, stream = reasoning_parser(name), reasoning_parser(name).stream()
    for size, char in enumerate(text, start=1):
        stream.feed(char)
        start = parser.content_start(text[:size])
        assert stream.ended == parser.reasoning_ended(text[:size]) == (start is not None), text[:size]
        if start is not None:  # from there on, all of the text is content
            assert (text[start:] or None) == parser.parse(text).content


def test_content_start_points_past_the_closing_tag():
    qwen3, deepseek = reasoning_parser("qwen3"), reasoning_parser("deepseek_r1")
    assert [qwen3.content_start(text) for text in ["", "  <thi", "<think>a</thi", "<think>a</think>b", "Hi"]] == [
        None, None, None, 16, 0]
    assert [deepseek.content_start(text) for text in ["", "Hi", "Hi</think>", " <think>a</think>"]] == [
        None, None, 10, 17]


FRAGMENTS = ["<think>", "</think>", "<thi", "</th", "<", "/", ">", " ", "\n", "a", "\u00e9\u4f60", "think"]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_streaming_matches_parse_on_random_texts(name: str):
    rng, both = random.Random(name), 0
    for _ in range(400):
        opening = rng.choice(["", "<think>", "\n<think>"])  # qwen3 reasons only in texts that open so
        text = opening + "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 10)))
        expected = reasoning_parser(name).parse(text)
        both += None not in expected
        for pieces in [list(text), *random_chunkings(text, range(3), MAX_CUTS)]:
            assert streamed(name, pieces) == expected, pieces
    assert both > 20, f"the random texts must hold reasoning and content both to test the split, {both} did"


def test_the_stream_holds_back_what_could_begin_a_tag():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed(" <th") == [] and stream.feed("ink>why</th") == [ReasoningDelta("why", None)]
    assert stream.feed("ink>so") == [ReasoningDelta(None, "so")] and stream.ended
    stream = reasoning_parser("deepseek_r1").stream()
    assert stream.feed("r</thin") == [ReasoningDelta("r", None)]
    assert stream.finish() == [ReasoningDelta("</thin", None)] and not stream.ended


def test_a_finished_stream_refuses_more_text():
    stream = reasoning_parser("qwen3").stream()
    stream.finish()
    with pytest.raises(RuntimeError, match="after"):
        stream.feed("x")


def test_an_unknown_parser_name_lists_the_known_ones():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1, qwen3, got 'granite'"):
        reasoning_parser("granite")
