"""Incremental detokenization that starts from the prompt's last tokens: the streamed completion continues the
prompt's text exactly (the space before the first generated word included) with byte-level BPE, SentencePiece
(Metaspace, Llama 2's byte fallback) and word-level tokenizers, and never emits half a character."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from pegainfer.runtime.detokenize import (PROMPT_CONTEXT_TOKENS, REPLACEMENT, IncrementalDetokenizer,
                                          decode_completion, token_text)
from pegainfer.runtime.tokenizer import TextTokenizer

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "hello world, the end", "w5 w6 w388 is a word"] * 20
SPECIALS = ["<unk>", "<s>", "</s>"]
WORDS = ["the", "cat", "sat", "on", "mat", "hello", "world", "caf", "done"]


def byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def sentencepiece(decoder: str) -> Tokenizer:
    """A unigram model with byte fallback. "llama2": Llama 2's tokenizer.json (a normalizer prepends and spells
    spaces as U+2581; Replace, ByteFallback, Fuse, Strip decode). "metaspace": the Metaspace pre-tokenizer and
    decoder of newer conversions (Mistral v0.1)."""
    pieces = [(t, 0.0) for t in SPECIALS] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    pieces += [("▁", -2.0)] + [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz,."] + [("▁" + w, -1.0) for w in WORDS]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    if decoder == "llama2":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                               decoders.Strip(" ", 1, 0)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def word_level() -> Tokenizer:
    """As `make-checkpoint --tokenizer words` makes it: one word an id, split on whitespace, no decoder."""
    vocab = {token: i for i, token in enumerate(SPECIALS)} | {f"w{i}": i for i in range(3, 512)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


KINDS = {"byte-level": byte_level, "llama2": lambda: sentencepiece("llama2"),
         "metaspace": lambda: sentencepiece("metaspace"), "words": word_level}
# prompt, completion: the completion starts with a word after a space, as a generated continuation does
TEXTS = {"byte-level": ("hello world, the cat", " sat on the mat"), "llama2": ("hello world the cat", " sat on the mat"),
         "metaspace": ("hello world the cat", " sat on the mat"), "words": ("w5 w6", " w388 w7 w9")}


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request) -> tuple[str, TextTokenizer]:
    return request.param, TextTokenizer(KINDS[request.param](), frozenset())


def split(tokenizer: TextTokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    prompt_ids, ids = tokenizer.encode(prompt), tokenizer.encode(prompt + completion)
    assert ids[:len(prompt_ids)] == prompt_ids, "the prompt must encode to a prefix of the whole text's ids"
    return prompt_ids, ids[len(prompt_ids):]


def stream(tokenizer: TextTokenizer, prompt_ids: list[int], ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detokenizer.add(t) for t in ids] + [detokenizer.flush()]


def test_the_stream_continues_the_prompt_text_with_its_leading_space(kind):
    name, tokenizer = kind
    prompt_ids, ids = split(tokenizer, *TEXTS[name])
    deltas = stream(tokenizer, prompt_ids, ids)
    assert tokenizer.decode(prompt_ids) + "".join(deltas) == tokenizer.decode(prompt_ids + ids)
    assert "".join(deltas) == TEXTS[name][1] and deltas[0].startswith(" ")
    if name != "byte-level":  # what the fix is for: alone, the first token's text has no space
        assert not tokenizer.decode(ids[:1]).startswith(" ")


def test_the_issue_example_echoes_with_the_space():
    tokenizer = TextTokenizer(word_level(), frozenset())
    prompt = tokenizer.encode("w5 w6")
    completion = decode_completion(tokenizer, prompt, [388])
    assert tokenizer.decode(prompt) + completion == "w5 w6 w388" == tokenizer.decode([*prompt, 388])


@pytest.mark.parametrize("name,text", [("byte-level", " naïve café 日本語 🙂 done"), ("llama2", " café 日本 🙂 done")])
def test_characters_split_over_byte_tokens_come_out_whole(name, text):
    tokenizer = TextTokenizer(KINDS[name](), frozenset())
    prompt_ids, ids = split(tokenizer, "hello world", text)
    assert any(REPLACEMENT in token_text(tokenizer, t) for t in ids), "some character must span several tokens"
    deltas = stream(tokenizer, prompt_ids, ids)
    assert "".join(deltas) == text and not any(REPLACEMENT in d for d in deltas)
    assert len([d for d in deltas if d]) < len(ids)  # bytes of one character were held back until it was whole


def test_random_completions_continue_any_prompt(kind):
    """Random ids, byte-fallback pieces left out: a run of them that is not UTF-8 decodes to a U+FFFD a byte as a
    whole, so later bytes take back a character its first bytes made, which no stream can emit in advance."""
    name, tokenizer = kind
    pool = [i for token, i in tokenizer.tokenizer.get_vocab().items() if not token.startswith("<0x")]
    rng = np.random.default_rng(0)
    for _ in range(40):
        prompt = tokenizer.encode(TEXTS[name][0])[:int(rng.integers(1, 2 * PROMPT_CONTEXT_TOKENS))]
        ids = rng.choice(pool, int(rng.integers(1, 30))).tolist()
        deltas = stream(tokenizer, prompt, ids)
        assert tokenizer.decode(prompt) + "".join(deltas) == tokenizer.decode(prompt + ids), (prompt, ids)
        assert all(not d.endswith(REPLACEMENT) for d in deltas[:-1])


def test_a_prompt_that_ends_inside_a_character_gets_it_whole_from_the_completion():
    tokenizer = TextTokenizer(byte_level(), frozenset())
    ids = tokenizer.encode("the cat 日本")
    cut = next(i for i in range(len(ids) - 1, 0, -1) if tokenizer.decode(ids[:i]).endswith(REPLACEMENT))
    prompt, completion = ids[:cut], ids[cut:] + tokenizer.encode(" done")
    assert "".join(stream(tokenizer, prompt, completion)).endswith("本 done")
    text = decode_completion(tokenizer, prompt, completion)
    assert tokenizer.decode(prompt).rstrip(REPLACEMENT) + text == "the cat 日本 done"


def test_without_a_prompt_the_stream_is_the_plain_decode(kind):
    name, tokenizer = kind
    ids = tokenizer.encode(TEXTS[name][0] + TEXTS[name][1])
    assert "".join(stream(tokenizer, [], ids)) == tokenizer.decode(ids)
