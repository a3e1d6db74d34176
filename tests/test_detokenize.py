"""Incremental detokenization (never half a UTF-8 character), stop strings across token boundaries, token bytes,
and the chat template, on the random checkpoint's byte-level BPE tokenizer."""

import json

import numpy as np
import pytest

from pegainfer.errors import RequestError
from pegainfer.runtime.chat import load_chat_template
from pegainfer.runtime.detokenize import REPLACEMENT, IncrementalDetokenizer, StopChecker, token_bytes, token_text
from pegainfer.runtime.tokenizer import load_tokenizer

TEXT = "naïve café: 日本語 — ünïcödé 🙂 done"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def stream(tokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.add(t) for t in ids] + [detokenizer.flush()]


def test_multibyte_characters_split_over_tokens_come_out_whole(tokenizer):
    ids = tokenizer.encode(TEXT)
    pieces = [token_text(tokenizer, t) for t in ids]
    assert any(REPLACEMENT in p for p in pieces), "the tokenizer should split some character over tokens"
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == TEXT == tokenizer.decode(ids)
    assert not any(REPLACEMENT in d for d in deltas)
    for delta in deltas:
        delta.encode("utf-8")  # every delta is whole characters


def test_incremental_equals_whole_decode_on_random_tokens(tokenizer):
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, 512, int(rng.integers(1, 40))).tolist()
        deltas = stream(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids)
        # a U+FFFD leaves only as part of the final flush, or when bytes after it completed a character
        assert all(not d.endswith(REPLACEMENT) for d in deltas[:-1])


def test_token_bytes_are_the_bytes_of_the_text(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert b"".join(token_bytes(tokenizer, t) for t in ids) == TEXT.encode()
    eos = tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert token_bytes(tokenizer, eos) == b"<|im_end|>" and token_text(tokenizer, eos) == "<|im_end|>"


def feed_all(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    checker = StopChecker(stops)
    out = ""
    for piece in pieces:
        out += checker.feed(piece)
        if checker.stopped:
            return out, True
    return out + checker.flush(), False


@pytest.mark.parametrize("pieces,stops,expected,stopped", [
    (["Hello wo", "rld, bye"], ["world"], "Hello ", True),  # across a boundary
    (["ab", "c", "d", "ef"], ["cde"], "ab", True),  # over three pieces
    (["abc", "xyz"], ["cx", "zz"], "ab", True),
    (["a<", "/s", "top>b"], ["</stop>"], "a", True),
    (["one ", "two"], ["three"], "one two", False),
    (["wor", "m"], ["world"], "worm", False),  # held back, then released when it cannot be a stop
    (["the end", ""], ["end", "the"], "", True),  # the earliest stop wins
    (["xx", "yy"], [""], "xxyy", False),  # an empty stop string means nothing
])
def test_stop_strings(pieces, stops, expected, stopped):
    assert feed_all(stops, pieces) == (expected, stopped)


def test_stop_checker_holds_back_only_a_possible_stop_prefix():
    checker = StopChecker(["STOP"])
    assert checker.feed("abcST") == "abc"
    assert checker.feed("x") == "STx"
    assert checker.feed("S") == ""
    assert checker.flush() == "S"


def test_chat_template_renders_the_checkpoint_template(tiny_checkpoint):
    template = load_chat_template(tiny_checkpoint)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert template.render(messages) == \
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert template.render(messages, add_generation_prompt=False).endswith("hi<|im_end|>\n")


def test_chat_template_kwargs_raise_exception_and_the_jinja_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{{ messages[0]['content'] | tojson }}{% if enable_thinking %}<think>{% endif %}{{ eos_token }}")
    template = load_chat_template(tmp_path)
    assert template.render([{"role": "user", "content": "é"}], enable_thinking=True) == '"é"<think></s>'
    with pytest.raises(RequestError, match="first must be user"):
        template.render([{"role": "assistant", "content": "x"}])
    (tmp_path / "chat_template.jinja").unlink()
    assert load_chat_template(tmp_path) is None
