"""Structured outputs against a live `serve --device cpu` on a random checkpoint with a byte-level tokenizer (its text
is noise: the grammar alone makes it valid), driven by the official openai client: response_format json_schema over
30 seeds validated by jsonschema, `chat.completions.parse` with a pydantic model, json_object, vLLM's
structured_outputs (choice, regex, json, grammar) and guided_* fields, n > 1 and streaming, and each bad input a 400
naming its parameter while the server keeps serving; and the host draw under a constraint, unit by unit."""

import json
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pydantic
import pytest

from live_server import NAME, start_server, stop_server
from pegainfer.ir.ops.sampling import sample_row
from pegainfer.runtime.constraint import draw_constrained, draw_masked, unpack_mask

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "admin", "tier"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "admin": {"type": "boolean"}, "tier": {"enum": ["free", "pro"]}}}
MESSAGES = [{"role": "user", "content": "Describe a user."}]


def loads(text: str):
    """JSON as xgrammar's grammar defines it: its strings may hold raw control characters, which Python's strict
    parser refuses (a random model draws them)."""
    return json.loads(text, strict=False)


class User(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(checkpoint_factory, tmp_path_factory):
    checkpoint = checkpoint_factory("structured_bpe", seed=5)
    log = tmp_path_factory.mktemp("structured") / "serve.log"
    server = start_server(checkpoint, log=log)
    yield server
    stop_server(server)


def test_json_schema_output_validates_over_30_seeds(server):
    client = server.client()
    for seed in range(30):
        result = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=96, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}})
        (choice,) = result.choices
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(loads(choice.message.content), SCHEMA)


def test_parse_returns_the_pydantic_object(server):
    for seed in range(5):
        result = server.client().chat.completions.parse(model=NAME, messages=MESSAGES, response_format=User,
                                                        max_tokens=64, seed=seed, temperature=0.8)
        parsed = result.choices[0].message.parsed
        assert isinstance(parsed, User) and 0 <= parsed.age <= 120


def test_json_object_gives_a_json_object(server):
    result = server.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=128, seed=3,
                                                     response_format={"type": "json_object"})
    text = result.choices[0].message.content
    if result.choices[0].finish_reason == "stop":  # a free-form object may run past max_tokens
        assert isinstance(loads(text), dict)
    assert text.lstrip().startswith("{")


@pytest.mark.parametrize("field, value, check", [
    ("choice", ["yes", "no", "maybe (later)"], lambda text: text in ("yes", "no", "maybe (later)")),
    ("regex", r"[a-c]{3}-[0-9]{2}", lambda text: len(text) == 6 and text[3] == "-" and text[4:].isdigit()),
    ("json", SCHEMA, lambda text: jsonschema.validate(loads(text), SCHEMA) is None),
    ("grammar", 'root ::= "ab" [0-9] [0-9]?', lambda text: text[:2] == "ab" and text[2:].isdigit()),
])
def test_structured_outputs_fields_constrain_completions(server, field, value, check):
    for seed in range(4):
        result = server.client().completions.create(model=NAME, prompt="Answer:", max_tokens=64, seed=seed,
                                                    temperature=1.0, extra_body={"structured_outputs": {field: value}})
        (choice,) = result.choices
        assert choice.finish_reason == "stop" and check(choice.text), (field, choice.text)


def test_guided_choice_and_n_give_each_choice_its_own_grammar(server):
    result = server.client().completions.create(model=NAME, prompt="Pick:", max_tokens=8, n=4, temperature=1.0,
                                                seed=1, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert len(result.choices) == 4 and all(c.text in ("red", "green", "blue") for c in result.choices)


def test_streamed_structured_output_equals_the_whole_one(server):
    body = dict(model=NAME, messages=MESSAGES, max_tokens=96, seed=11, temperature=1.0,
                response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}})
    whole = server.client().chat.completions.create(**body).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       server.client().chat.completions.create(**body, stream=True) if chunk.choices)
    assert streamed == whole
    jsonschema.validate(loads(streamed), SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "not an object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_structured_output_is_a_400_naming_it_and_the_server_keeps_serving(server, body, param):
    reply = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES,
                                                                  "max_tokens": 4, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    ok = server.client().completions.create(model=NAME, prompt="still", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_response_format_text_is_plain_generation(server):
    args = dict(model=NAME, prompt="Plain", max_tokens=6, temperature=0)
    plain = server.client().completions.create(**args).choices[0].text
    text = server.client().completions.create(**args, extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == plain


class Only:
    """A constraint allowing a fixed set of ids, recording what it accepted."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.accepted = ids, []

    def allowed(self, vocab_size: int) -> np.ndarray:
        mask = np.zeros(vocab_size, dtype=bool)
        mask[self.ids] = True
        return mask

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_a_constrained_draw_keeps_to_the_mask_and_reports_the_logprob_among_what_it_allows():
    """As vLLM reports logprobs under a grammar: those of the masked logits (the mask applied before the sampler)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(50).astype(np.float32) * 3
    x[7] = 20.0  # the unconstrained argmax, not allowed
    only = Only([3, 11, 42])
    token, logprob = draw_constrained(x, only, (0.0, 0, 1.0, 0.0, 1, 0))  # greedy
    assert token == [3, 11, 42][int(np.argmax(x[[3, 11, 42]]))] and only.accepted == [token]
    kept = x[[3, 11, 42]].astype(np.float64)
    expected = x[token] - (kept.max() + np.log(np.exp(kept - kept.max()).sum()))
    assert logprob == pytest.approx(float(expected), abs=1e-5)
    for seed in range(20):  # sampled: still inside the mask
        token, _ = draw_constrained(x, Only([3, 11, 42]), (1.0, 0, 1.0, 0.0, seed, 0))
        assert token in (3, 11, 42)
    # a constraint that allows nothing, or raises, leaves the row free instead of stopping the engine
    assert draw_constrained(x, Only([]), (0.0, 0, 1.0, 0.0, 1, 0))[0] == 7

    class Raising(Only):
        def allowed(self, vocab_size: int) -> np.ndarray:
            raise RuntimeError("the grammar library failed")
    assert draw_constrained(x, Raising([3]), (0.0, 0, 1.0, 0.0, 1, 0))[0] == 7


@pytest.mark.parametrize("allowed_share", [0.001, 0.3, 1.0])
def test_a_masked_draw_is_the_sample_ops_token(allowed_share):
    """draw_masked's shortcut (noise for the allowed ids alone) gives the token sample_row gives the masked row."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(5000).astype(np.float32) * 2
    row = np.where(rng.random(5000) < allowed_share, x, -np.inf).astype(np.float32)
    row[17] = x[17]  # at least one allowed
    for seed in range(25):
        for sampling in ((1.0, 0, 1.0, 0.0, seed, 4), (0.7, 0, 1.0, 0.0, seed, 9), (0.0, 0, 1.0, 0.0, seed, 0),
                         (1.0, 40, 0.9, 0.0, seed, 2)):
            assert draw_masked(row, sampling) == sample_row(row, *sampling), (seed, sampling)


def test_grammar_cache_compiles_a_schema_once(tmp_path: Path):
    from pegainfer.runtime.tokenizer import load_tokenizer
    from pegainfer.fixtures.checkpoint import make_checkpoint
    from pegainfer.server.structured import GrammarSpec, Grammars

    checkpoint = make_checkpoint(tmp_path / "c", seed=2)
    grammars = Grammars(load_tokenizer(checkpoint), json.loads((checkpoint / "config.json").read_text())["vocab_size"])
    spec = GrammarSpec("json", json.dumps(SCHEMA), "response_format")
    first, second = grammars.constraint_factory(spec), grammars.constraint_factory(spec)
    assert len(grammars._cache) == 1 and first() is not second()
    mask = first().allowed(grammars.vocab_size)
    assert mask.shape == (grammars.vocab_size,) and 0 < mask.sum() < mask.size


def test_masks_filled_together_equal_each_filled_alone_and_follow_each_accepted_token(tmp_path: Path):
    from pegainfer.fixtures.checkpoint import make_checkpoint
    from pegainfer.runtime.constraint import Chain, PenaltyState, bitmask_of
    from pegainfer.runtime.device_sampling import device_masks
    from pegainfer.ir.ops.penalties import Penalties
    from pegainfer.runtime.tokenizer import load_tokenizer
    from pegainfer.server.structured import GrammarSpec, Grammars

    checkpoint = make_checkpoint(tmp_path / "c", seed=2)
    tokenizer = load_tokenizer(checkpoint)
    grammars = Grammars(tokenizer, json.loads((checkpoint / "config.json").read_text())["vocab_size"])
    vocab = grammars.vocab_size
    schema, choice = (grammars.constraint_factory(GrammarSpec("json", json.dumps(SCHEMA), "response_format")),
                      grammars.constraint_factory(GrammarSpec("choice", json.dumps(["yes", "no"]), "x")))
    together = [schema(), schema(), choice(), None, schema()]
    alone = [schema(), schema(), choice(), None, schema()]
    penalties = Penalties(presence=0.5)
    together[4] = Chain(together[4], PenaltyState(penalties, [1, 2], vocab, []))
    alone[4] = Chain(alone[4], PenaltyState(penalties, [1, 2], vocab, []))
    prefixes = [tokenizer.encode('{"name": "'), tokenizer.encode("{"), [], [], tokenizer.encode('{"name": "a", "age"')]
    for row, prefix in enumerate(prefixes):
        for token in prefix:
            for constraints in (together, alone):
                constraints[row].accept(token)
    for step in range(3):
        masks = device_masks(together, vocab)
        expected = {row: bitmask_of(c, vocab) for row, c in enumerate(alone) if c is not None}
        assert sorted(masks) == [0, 1, 2, 4]
        for row, words in masks.items():
            np.testing.assert_array_equal(words, expected[row])
        assert len({words.tobytes() for words in masks.values()}) > 1  # the rows are in different states
        for row, words in masks.items():  # each row takes its lowest allowed id: the next masks must follow it
            token = int(np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))[0])
            together[row].accept(token)
            alone[row].accept(token)


@pytest.mark.parametrize("extra_stop", [None, 1500, 2500])
def test_masks_over_a_tokenizer_smaller_than_the_vocabulary_equal_those_compiled_over_every_id(
        tmp_path: Path, extra_stop: int | None):
    """A model vocabulary padded past its tokenizer (742 tokens under 2000 ids): the grammars are compiled over the
    tokenizer's ids (xgrammar's fill clears every other id one by one) and widened; each mask, filled alone or with
    others, equals the one of the same grammar compiled over all 2000 ids, and allows no id past the tokenizer's
    (or a stop id past them: generation_config's eos 1500, the grammars then covering 1501 ids; an eos past the
    vocabulary, 2500, is left out)."""
    import xgrammar
    from transformers import PreTrainedTokenizerFast
    from pegainfer.fixtures.checkpoint import make_checkpoint
    from pegainfer.runtime.device_sampling import device_masks
    from pegainfer.runtime.tokenizer import load_tokenizer
    from pegainfer.server.structured import GrammarConstraint, GrammarSpec, Grammars

    shape = {"vocab_size": 2000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    checkpoint = make_checkpoint(tmp_path / "c", overrides=shape, seed=2)
    if extra_stop is not None:
        generation = json.loads((checkpoint / "generation_config.json").read_text())
        generation["eos_token_id"] = [*generation["eos_token_id"], extra_stop]
        (checkpoint / "generation_config.json").write_text(json.dumps(generation))
    tokenizer = load_tokenizer(checkpoint)
    vocab = 2000
    grammars = Grammars(tokenizer, vocab)
    narrow = grammars.constraint_factory(GrammarSpec("json", json.dumps(SCHEMA), "response_format"))
    tokens = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    assert grammars._tokens == (extra_stop + 1 if extra_stop == 1500 else tokens) < vocab
    stops = sorted(t for t in tokenizer.eos_token_ids if t < vocab)
    info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer),
                                                   vocab_size=vocab, stop_token_ids=stops)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    prefixes = ['{"name": "', "{", "", '{"name": "ab", "age": 1', '{"name": "a", "age": 3, "admin": true, "tier": ']
    together, alone = [narrow() for _ in prefixes], [narrow() for _ in prefixes]
    wide = [GrammarConstraint(xgrammar.GrammarMatcher(compiled), grammars._control_tokens, stops) for _ in prefixes]
    for row, prefix in enumerate(prefixes):
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            for constraints in (together, alone, wide):
                constraints[row].accept(token)
    for step in range(4):
        masks = device_masks(together, vocab)
        for row in range(len(prefixes)):
            expected = wide[row].bitmask(vocab)
            np.testing.assert_array_equal(masks[row], expected, err_msg=f"row {row}, step {step}")
            np.testing.assert_array_equal(alone[row].bitmask(vocab), expected)
            allowed = np.flatnonzero(unpack_mask(expected, vocab))
            assert allowed.size and allowed.max() < grammars._tokens
            for constraints in (together, alone, wide):
                constraints[row].accept(int(allowed[-1]))
