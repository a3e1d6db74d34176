"""Tool-call parsers, selected by name as vLLM's --tool-call-parser is: each turns a model's text into content and
OpenAI tool calls, whole (parse) or delta by delta (stream). Both run one scan() of what a text, or a prefix of one,
makes certain, so they agree however the text is cut; a call streams once it is known to parse (its closing tag or
bracket has come). Text that looks like a call but does not parse stays content: model output never raises."""

import json
import random
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

IdGenerator = Callable[[], str]
Call = tuple[str, str]  # (name, arguments as JSON text)
Event = str | Call  # content text, or a call
Scan = tuple[list[Event], int, str]  # (what a text settles, in order; how much of it that took; the state after it)
Decision = tuple[int, list[Call] | None]  # (how much of a block's text it took, its calls or None: it is content)
ALPHANUMERICS = string.ascii_letters + string.digits
ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes parameters, the others arguments: each takes both


def random_call_id() -> str:
    """An id shaped as OpenAI's (call_ and 24 random alphanumerics), for clients that check the shape."""
    return "call_" + "".join(secrets.choice(ALPHANUMERICS) for _ in range(24))


def seeded_call_ids(seed: int) -> IdGenerator:
    """OpenAI-shaped ids that repeat for a seed, so that tests and replays can compare calls whole."""
    rng = random.Random(seed)
    return lambda: "call_" + "".join(rng.choice(ALPHANUMERICS) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class Delta:
    """One streamed piece: content, or a piece of tool call `index` (the first: id and name, arguments "")."""
    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        """A chunk's delta object, as OpenAI streams it."""
        if self.index is None:
            return {"content": self.content}
        head = {} if self.id is None else {"id": self.id, "type": "function"}
        function = ({} if self.name is None else {"name": self.name}) | {"arguments": self.arguments}
        return {"tool_calls": [{"index": self.index, **head, "function": function}]}


def assemble(deltas: Iterable[Delta]) -> ParsedOutput:
    """What a client makes of a stream: the content joined, and each call's argument pieces joined by index."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.index is None:
            content.append(delta.content or "")
        elif delta.id is not None:
            calls[delta.index] = [delta.id, delta.name or "", delta.arguments]
        else:
            calls[delta.index][2] += delta.arguments
    return ParsedOutput("".join(content) or None, [ToolCall(*calls[index]) for index in sorted(calls)])


def _refuse_constant(name: str) -> float:
    """NaN and Infinity are not JSON, and an OpenAI client could not read them back."""
    raise ValueError(f"expected standard JSON, found the constant {name}")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, strict=False)  # models write raw newlines in strings


def _decode(text: str, start: int, final: bool = True) -> tuple[Any, int] | None:
    """The JSON value at text[start] and the index after it, or None where none is there (yet). A stream's text
    that does not end in a closing bracket is not decoded yet (None, as for an open value): re-decoding an open
    call at every delta would cost the square of its length; at the end (final) it is decoded whatever it is."""
    if not final and not text.rstrip().endswith(("}", "]")):
        return None
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None


def _json_object(text: str) -> dict[str, Any] | None:
    """text as one JSON object (whitespace around it allowed), or None."""
    text = text.strip()
    decoded = _decode(text, 0)
    return decoded[0] if decoded and decoded[1] == len(text) and isinstance(decoded[0], dict) else None


def _call_of(value: Any) -> Call | None:
    """(name, arguments JSON) of a decoded call object, or None where it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = next((value[key] for key in ARGUMENT_KEYS if key in value), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        arguments = _json_object(arguments)
    if not isinstance(arguments, dict):
        return None
    try:
        return value["name"], json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):  # 1e999 decodes to inf, which JSON cannot carry
        return None


def _calls_of(value: Any) -> list[Call] | None:
    """The calls of a decoded list of call objects (or of one bare object), or None unless each one is a call."""
    calls = [_call_of(item) for item in (value if isinstance(value, list) else [value])]
    return [call for call in calls if call] if calls and all(calls) else None


def _partial_tag(text: str, tag: str) -> int:
    """How long a suffix of text could still begin tag: that much is held back."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


class ToolParser(ABC):
    """One model family's tool-call syntax; stream() gives a fresh streaming parser for each choice."""
    INITIAL = "content"  # the scan state at the start of an output

    def __init__(self, new_id: IdGenerator = random_call_id) -> None:
        self.new_id = new_id

    def parse(self, text: str) -> ParsedOutput:
        """The content and tool calls of a whole text."""
        events = self.scan(text, self.INITIAL, final=True)[0]
        content = "".join(event for event in events if isinstance(event, str))
        calls = [ToolCall(self.new_id(), *event) for event in events if not isinstance(event, str)]
        return ParsedOutput(content or None, calls)

    def stream(self) -> "ToolCallStream":
        """A streaming parser for one output."""
        return ToolCallStream(self)

    @abstractmethod
    def scan(self, text: str, state: str, final: bool) -> Scan:
        """What text, met in state, settles: its content and calls in order, how many characters they took (the
        rest waits for more text), and the state there. final: no more text comes, so all of it is taken."""


class ToolCallStream:
    """The streaming side of a parser: feed it text deltas, then finish; each returns the deltas now certain, and
    what a later delta could still change (a possible tag, an open call) is held back."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._held = ""
        self._state = parser.INITIAL
        self._calls = 0
        self._finished = False

    def feed(self, delta: str) -> list[Delta]:
        """The deltas that the text so far settles."""
        if self._finished:
            raise RuntimeError("expected feed before finish, found a feed after it")
        return self._settle(delta, final=False)

    def finish(self) -> list[Delta]:
        """The deltas of what was held back, now that the text is complete."""
        if self._finished:
            return []
        self._finished = True
        return self._settle("", final=True)

    def _settle(self, delta: str, final: bool) -> list[Delta]:
        text = self._held + delta
        events, used, self._state = self._parser.scan(text, self._state, final)
        self._held = text[used:]
        deltas: list[Delta] = []
        for event in events:
            if isinstance(event, str):
                deltas += [Delta(content=event)] if event else []
                continue
            index, self._calls = self._calls, self._calls + 1
            deltas += [Delta(index=index, id=self._parser.new_id(), name=event[0]),
                       Delta(index=index, arguments=event[1])]
        return deltas


class _TaggedParser(ToolParser):
    """Content with call blocks that START opens: a block that parses is calls, one that does not stays content,
    and the whitespace right after calls is dropped. Content is held back only where it could begin START."""
    START = ""

    @abstractmethod
    def close(self, body: str, final: bool) -> Decision | None:
        """How a block ends, body being the text after START, or None while that is not known yet; final: body is
        all the rest of the output."""

    def scan(self, text: str, state: str, final: bool) -> Scan:
        events: list[Event] = []
        pos = 0
        while True:
            if state == "after":
                pos = _skip_space(text, pos)
                if pos == len(text):
                    return events, pos, state
                state = "content"
            start = text.find(self.START, pos)
            if start < 0:
                cut = len(text) - (0 if final else _partial_tag(text[pos:], self.START))
                return [*events, text[pos:cut]], cut, state
            events.append(text[pos:start])
            body = start + len(self.START)
            decision = self.close(text[body:], final)
            if decision is None:
                return events, start, state
            used, calls = decision
            events += calls or [text[start:body + used]]
            pos, state = body + used, "after" if calls else "content"


class HermesToolParser(_TaggedParser):
    """Hermes, as Qwen2.5 and Qwen3 write it: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks. As
    in vLLM, a block left open at the end of the output is a call where its text parses as one."""
    START, END = "<tool_call>", "</tool_call>"

    def close(self, body: str, final: bool) -> Decision | None:
        end = body.find(self.END)
        if end < 0 and not final:
            return None
        inside, used = (body, len(body)) if end < 0 else (body[:end], end + len(self.END))
        call = _call_of(_json_object(inside))
        return used, [call] if call else None


class MistralToolParser(_TaggedParser):
    """Mistral: [TOOL_CALLS] and a JSON list of {"name": ..., "arguments": {...}} (a bare object is taken too)."""
    START = "[TOOL_CALLS]"

    def close(self, body: str, final: bool) -> Decision | None:
        first = _skip_space(body, 0)
        if first < len(body) and body[first] not in "[{":
            return 0, None
        decoded = _decode(body, first, final) if first < len(body) else None
        if decoded:
            return decoded[1], _calls_of(decoded[0])
        return (len(body), None) if final else None


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON calls: the output is {"name": ..., "parameters": {...}} objects, optionally after
    <|python_tag|>, separated by ;. An output that does not start with a call is all content; after the calls,
    the rest (from the first text that is not one) is content."""
    TAG = "<|python_tag|>"
    INITIAL = "start"  # then "after" a call, "separated" (after its ;), or "content" for the rest

    def scan(self, text: str, state: str, final: bool) -> Scan:
        if state == "content":
            return [text], len(text), state
        events: list[Event] = []
        pos = 0
        if state == "start":
            pos = _skip_space(text, 0)
            if text.startswith(self.TAG, pos):
                pos = _skip_space(text, pos + len(self.TAG))
            elif self.TAG.startswith(text[pos:]):
                pos = len(text)  # the tag may still come
            if pos == len(text) and not final:
                return [], 0, state
        while True:
            if state != "start":
                pos = _skip_space(text, pos)
                if state == "after" and text.startswith(";", pos):
                    pos, state = _skip_space(text, pos + 1), "separated"
                if pos == len(text):
                    return events, pos, state
            opens = text.startswith("{", pos)
            decoded = _decode(text, pos, final) if opens else None
            if decoded and (call := _call_of(decoded[0])):
                events.append(call)
                pos, state = decoded[1], "after"
            elif opens and decoded is None and not final:  # the object is still open
                return events, 0 if state == "start" else pos, state
            else:  # before the first call the whole text is content, after one the rest
                return [*events, text if state == "start" else text[pos:]], len(text), "content"


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser}


def tool_parser(name: str, new_id: IdGenerator = random_call_id) -> ToolParser:
    """The parser that vLLM's --tool-call-parser NAME selects, so that a server flag can name it the same way."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool-call parser must be one of {', '.join(sorted(TOOL_PARSERS))}, got {name!r}")
    return TOOL_PARSERS[name](new_id)
