"""`pegainfer bench serve --tokenizer`: every random prompt is text that encodes to exactly --input-len tokens, as
the server counts them (usage.prompt_tokens, special tokens included), where decoded random ids alone re-encode
to far more with a byte-level BPE."""

import numpy as np
import pytest
from tokenizers import processors
from test_tokenizer_routes import app, bos_checkpoint, call  # noqa: F401  (fixtures)

from pegainfer.errors import PegainferError
from pegainfer.runtime.tokenizer import load_tokenizer
from pegainfer.server.bench import BenchConfig, fit_prompt, random_prompts, whole_tokens

LENGTHS = [1, 2, 7, 24, 300]


def config(folder, input_len: int, num_prompts: int = 20, seed: int = 0) -> BenchConfig:
    return BenchConfig("http://127.0.0.1:8000", "tiny", input_len=input_len, num_prompts=num_prompts, seed=seed,
                       tokenizer=folder)


def test_decoded_random_ids_alone_miss_the_length(tiny_checkpoint):
    """What the fitting is for: the tiny checkpoint's byte-level BPE re-encodes random ids to half as many again."""
    tokenizer = load_tokenizer(tiny_checkpoint)
    vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=False)
    ids = np.random.default_rng(0).integers(0, vocab, (10, 256)).tolist()
    assert np.mean([len(tokenizer.encode(tokenizer.decode(i))) for i in ids]) > 1.3 * 256


@pytest.mark.parametrize("input_len", LENGTHS)
def test_every_prompt_encodes_to_exactly_input_len_tokens(tiny_checkpoint, input_len):
    tokenizer = load_tokenizer(tiny_checkpoint)
    prompts = random_prompts(config(tiny_checkpoint, input_len, seed=input_len))
    assert len(prompts) == 20 and len(set(prompts)) == 20 and all(isinstance(p, str) for p in prompts)
    assert [len(tokenizer.encode(p)) for p in prompts] == [input_len] * 20
    assert random_prompts(config(tiny_checkpoint, input_len, seed=input_len)) == prompts  # seeded


def test_the_server_counts_input_len_prompt_tokens_special_tokens_included(app, bos_checkpoint):  # noqa: F811
    """The BOS checkpoint's tokenizer adds a token to every prompt: the server's usage counts it, and so does the
    fitting."""
    for input_len in (2, 24):
        for prompt in random_prompts(config(bos_checkpoint, input_len, num_prompts=4)):
            response = call(app, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == input_len


def test_whole_tokens_leave_out_special_tokens_and_parts_of_characters(tiny_checkpoint):
    tokenizer = load_tokenizer(tiny_checkpoint)
    pool = set(whole_tokens(tokenizer).tolist())
    specials = {tokenizer.tokenizer.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert pool and not pool & specials
    assert all("\ufffd" not in tokenizer.decode([i]) for i in pool)


def test_a_length_shorter_than_the_special_tokens_is_refused(bos_checkpoint):  # noqa: F811
    tokenizer = load_tokenizer(bos_checkpoint)
    rng = np.random.default_rng(0)
    pool = whole_tokens(tokenizer)
    assert tokenizer.encode(fit_prompt(tokenizer, pool[:5].tolist(), 1, pool, rng)) == tokenizer.encode("")
    inner = tokenizer.tokenizer
    ends = [(t, inner.token_to_id(t)) for t in ("<|endoftext|>", "<|im_end|>")]
    inner.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A <|im_end|>", special_tokens=ends)
    with pytest.raises(PegainferError, match="adds 2 special tokens to every prompt"):
        fit_prompt(tokenizer, pool[:5].tolist(), 1, pool, rng)
    assert len(tokenizer.encode(fit_prompt(tokenizer, pool[:5].tolist(), 9, pool, rng))) == 9
