"""Structured outputs: a request's `response_format` (text, json_object, json_schema) or vLLM's `structured_outputs`
(json, regex, choice, grammar; and the older guided_json, guided_regex, guided_choice, guided_grammar) compiled by
xgrammar into a grammar, and each of its choices given a matcher that masks the tokens the grammar does not allow
at every draw (runtime/constraint.py). Compiled grammars are cached by their source, the compiler built once per
tokenizer."""

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from pegainfer.runtime.constraint import pack_mask, unpack_mask
from pegainfer.runtime.tokenizer import TextTokenizer
from pegainfer.server.errors import ApiError

INSTALL = "structured outputs need the xgrammar package: pip install 'pegainfer[structured]'"
KINDS = ("json", "regex", "choice", "grammar")  # structured_outputs' fields, one at a time
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
JSON_KINDS = ("json", "json_object")
CACHED_GRAMMARS = 256  # compiled grammars kept, the least recently used dropped first


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: a kind (json, json_object, regex, choice, grammar, or a tool
    call's structural tag) and its source, as a string, the cache key; `param` names the field for errors."""
    kind: str
    source: str
    param: str


def requested_spec(body: Any) -> GrammarSpec | None:
    """The one grammar a request asks for, or None (response_format text, or nothing); two at once is a 400."""
    specs = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        spec = _response_format_spec(response_format)
        if spec is not None:
            specs.append(spec)
    outputs = getattr(body, "structured_outputs", None)
    if outputs is not None:
        specs.append(_structured_outputs_spec(outputs))
    for name, kind in GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            specs.append(_spec(kind, value, name))
    if len(specs) > 1:
        raise ApiError(400, f"one structured output at a time; found {', '.join(s.param for s in specs)}",
                       specs[1].param)
    return specs[0] if specs else None


def _response_format_spec(value: Any) -> GrammarSpec | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("schema", {}), dict):
            raise ApiError(400, "response_format.json_schema must be an object with a `schema` object",
                           "response_format")
        return GrammarSpec("json", json.dumps(schema.get("schema", {})), "response_format")
    raise ApiError(400, f"response_format.type must be text, json_object or json_schema, found {kind!r}",
                   "response_format")


def _structured_outputs_spec(value: Any) -> GrammarSpec:
    given = [k for k in KINDS if isinstance(value, dict) and value.get(k) is not None]
    if len(given) != 1:
        raise ApiError(400, f"structured_outputs must set exactly one of {', '.join(KINDS)}, found "
                       f"{given or 'none'}", "structured_outputs")
    return _spec(given[0], value[given[0]], "structured_outputs")


def _spec(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ApiError(400, f"{param}: the JSON schema is not valid JSON ({error})", param) from None
        if not isinstance(value, dict):
            raise ApiError(400, f"{param}: a JSON schema must be an object, found {type(value).__name__}", param)
        return GrammarSpec("json", json.dumps(value), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ApiError(400, f"{param}: choice must be a non-empty list of strings", param)
        return GrammarSpec("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{param}: {kind} must be a non-empty string", param)
    return GrammarSpec(kind, value, param)


def after_reasoning(spec: GrammarSpec, parser: str) -> GrammarSpec:
    """The spec constrained only once the model's reasoning has ended: free text inside <think>...</think> (the
    prompt opened the tag for deepseek_r1; qwen3 writes it), whitespace, then the spec's output."""
    think = {"type": "tag", "begin": "" if parser == "deepseek_r1" else "<think>", "content": {"type": "any_text"},
             "end": "</think>"}
    elements = [think, {"type": "regex", "pattern": "\\s*"}, _format_of(spec)]
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "sequence", "elements": elements}}), spec.param)


def _format_of(spec: GrammarSpec) -> dict[str, Any]:
    """A spec as an element of a structural tag."""
    if spec.kind in JSON_KINDS:
        schema = json.loads(spec.source) if spec.kind == "json" else {"type": "object"}
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.source}
    if spec.kind == "choice":
        return {"type": "regex", "pattern": "|".join(_regex_literal(c) for c in json.loads(spec.source))}
    if spec.kind == "structural_tag":
        return json.loads(spec.source)["format"]
    return {"type": "grammar", "grammar": spec.source}


@dataclass
class Grammars:
    """The xgrammar compiler of one tokenizer and the grammars it compiled, by spec."""
    tokenizer: TextTokenizer
    vocab_size: int
    _compiler: Any = None
    _cache: OrderedDict[tuple[str, str], Any] = field(default_factory=OrderedDict)  # least recently used first
    _lock: threading.Lock = field(default_factory=threading.Lock)  # requests compile in worker threads
    _control_tokens: np.ndarray | None = None  # ids whose bytes hold a control character (U+0000-U+001F)
    _tokens: int = 0  # the ids the grammars are compiled over: the tokenizer's (tokenizer_ids)

    def constraint_factory(self, spec: GrammarSpec) -> Callable[[], "GrammarConstraint"]:
        """A maker of fresh matchers (one per choice) of the spec's compiled grammar; a 400 naming the spec's
        field where xgrammar refuses it."""
        compiled = self._compiled(spec)
        import xgrammar

        banned = self._control_tokens if spec.kind in JSON_KINDS else None
        stops = self._stops()
        return lambda: GrammarConstraint(xgrammar.GrammarMatcher(compiled), banned, stops, self._tokens)

    def _compiled(self, spec: GrammarSpec) -> Any:
        key = (spec.kind, spec.source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiler = self._compiler_once(spec.param)
        try:
            compiled = _compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ApiError(400, f"{spec.param}: xgrammar cannot compile this {spec.kind} ({error})",
                           spec.param) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHED_GRAMMARS:  # a client's stream of new schemas stays bounded
                self._cache.popitem(last=False)
        return compiled

    def _compiler_once(self, param: str) -> Any:
        if self._compiler is None:
            try:
                import xgrammar
                from transformers import PreTrainedTokenizerFast
            except ImportError:
                raise ApiError(400, INSTALL, param) from None
            fast = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.tokenizer)
            self._tokens = tokenizer_ids(self.tokenizer, self._stops(), self.vocab_size)
            info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=self._tokens,
                                                           stop_token_ids=self._stops())
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # ours is bounded
            # JSON forbids raw control characters in strings, which xgrammar's string rule lets through
            self._control_tokens = np.zeros(self.vocab_size, dtype=bool)
            for token, text in enumerate(info.decoded_vocab[:self._tokens]):
                self._control_tokens[token] = any(byte < 0x20 for byte in text)
            self._control_tokens[self._stops()] = False
        return self._compiler

    def _stops(self) -> list[int]:
        """The stop ids the model can draw: an eos id past its vocabulary (a checkpoint's slip) is left out."""
        return sorted(t for t in self.tokenizer.eos_token_ids if t < self.vocab_size)


def tokenizer_ids(tokenizer: TextTokenizer, stops: list[int], vocab_size: int) -> int:
    """How many ids a grammar's masks cover: the tokenizer's and its `stops`, not the model's padded vocabulary.
    xgrammar counts every id past the tokenizer as a special token and clears it bit by bit at every fill: 0.16 ms a
    row for a 742-token tokenizer under 151,936 ids, against 2.4 us over its own ids."""
    return min(vocab_size, max([*tokenizer.tokenizer.get_vocab(with_added_tokens=True).values(), *stops]) + 1)


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.kind == "json_object":  # an object, not any JSON value (the builtin grammar's)
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind == "json":  # compact: no run of whitespace for a weak model to loop in
        return compiler.compile_json_schema(spec.source, any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "choice":
        return compiler.compile_regex("|".join(_regex_literal(c) for c in json.loads(spec.source)))
    if spec.kind == "structural_tag":
        return compiler.compile_structural_tag(spec.source)
    return compiler.compile_grammar(spec.source)


@lru_cache(maxsize=1)
def batch_matcher() -> Any:
    """xgrammar's batch matcher, on half the cores this process may use (its own default counts the machine's),
    made once."""
    import xgrammar

    return xgrammar.BatchGrammarMatcher(max(1, len(os.sched_getaffinity(0)) // 2))


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it."""
    return "".join("\\" + c if c in r".^$*+?{}[]\|()" else c for c in text)


class GrammarConstraint:
    """A TokenConstraint over one xgrammar matcher: the next token's mask from its bitmask (less `banned` ids),
    each drawn token accepted. Once the grammar has ended (its stop token drawn: a request that ignores EOS goes
    on) only stop tokens are allowed; a token the matcher refuses ends the constraint rather than the engine.
    The matcher's grammar covers `tokens` ids (tokenizer_ids); ids past them are never allowed."""

    def __init__(self, matcher: Any, banned: np.ndarray | None = None, stops: list[int] | None = None,
                 tokens: int | None = None) -> None:
        self.matcher, self.banned, self.stops, self.tokens = matcher, banned, stops or [], tokens
        self._banned_words: np.ndarray | None = None
        self._filled: np.ndarray | None = None  # the next token's words, filled with others' (fill_together)
        self.broken = False

    @staticmethod
    def fill_together(grammars: list["GrammarConstraint"], vocab_size: int) -> None:
        """The next token's bitmasks of several grammars in one call of xgrammar's batch fill, on its threads:
        a step's rows at once instead of one after another. Into a NumPy buffer: a torch allocation each step
        leaves torch's CPU threads spinning on the cores xgrammar's threads need."""
        live = [g for g in grammars if not g.broken and not g.matcher.is_terminated()]
        widths = {g.tokens or vocab_size for g in live}
        if len(live) < 2 or len(widths) > 1:  # one tokenizer's grammars: a step never mixes widths
            return
        words = np.zeros((len(live), _words(widths.pop())), dtype=np.int32)
        batch_matcher().batch_fill_next_token_bitmask([g.matcher for g in live], words)
        for grammar, row in zip(live, words):
            grammar._filled = grammar._widened(row, vocab_size)

    def _widened(self, words: np.ndarray, vocab_size: int) -> np.ndarray:
        """The matcher's words over the model's vocabulary: the bits past its `tokens` cleared."""
        tokens = min(self.tokens or vocab_size, vocab_size)
        wide = np.zeros(_words(vocab_size), dtype=np.int32)
        wide[: _words(tokens)] = words[: _words(tokens)]
        if tokens % 32:
            wide[tokens // 32] &= np.int32((1 << tokens % 32) - 1)
        return wide

    def allowed(self, vocab_size: int) -> np.ndarray:
        words = self.bitmask(vocab_size)
        return np.ones(vocab_size, dtype=bool) if words is None else unpack_mask(words, vocab_size)

    def bitmask(self, vocab_size: int) -> np.ndarray | None:
        """The next token's allowed ids as int32 words (None: any): xgrammar's, less the banned ids; only stop
        tokens once the grammar has ended."""
        if self.broken or (self.matcher.is_terminated() and not self.stops):
            return None
        if self.matcher.is_terminated():
            mask = np.zeros(vocab_size, dtype=bool)
            mask[[s for s in self.stops if s < vocab_size]] = True
            return pack_mask(mask)
        if self._banned_words is None and self.banned is not None:
            self._banned_words = pack_mask(~self.banned)
        words, self._filled = self._filled, None
        if words is None:
            narrow = np.zeros((1, _words(self.tokens or vocab_size)), dtype=np.int32)
            self.matcher.fill_next_token_bitmask(narrow)
            words = self._widened(narrow[0], vocab_size)
        return words if self._banned_words is None else words & self._banned_words

    def accept(self, token: int) -> None:
        self._filled = None  # a mask filled ahead is the state before this token's
        if not self.broken and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            self.broken = True  # xgrammar disagreeing with its own mask: the rest of the output goes free

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()


def _words(ids: int) -> int:
    """int32 words of a bitmask over `ids` ids."""
    return -(-ids // 32)
