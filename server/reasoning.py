"""Reasoning parsers, selected by name as vLLM's --reasoning-parser is: they split a thinking model's
<think>...</think> from its answer, whole (parse) or delta by delta (stream), and the two agree however the text is
cut. content_start() says where the answer begins in the text so far: output constraints apply from there."""

from collections.abc import Iterable
from typing import NamedTuple

START, END = "<think>", "</think>"


class ReasoningOutput(NamedTuple):
    reasoning: str | None
    content: str | None


class ReasoningDelta(NamedTuple):
    """One streamed piece: exactly one of the two is set."""
    reasoning: str | None
    content: str | None


def assemble(deltas: Iterable[ReasoningDelta]) -> ReasoningOutput:
    """What a client makes of a stream: the reasoning pieces joined, and the content pieces."""
    reasoning, content = [], []
    for delta in deltas:
        reasoning.append(delta.reasoning or "")
        content.append(delta.content or "")
    return ReasoningOutput("".join(reasoning) or None, "".join(content) or None)


def _undecided(text: str) -> bool:
    """Whether text may still open with <think>: whitespace, then at most a beginning of the tag."""
    rest = text.lstrip()
    return len(rest) < len(START) and START.startswith(rest)


def _reasoning_start(text: str, prompt_opens: bool) -> int | None:
    """Where the reasoning begins in text: after an opening tag, at 0 where the prompt opened it, else None."""
    rest = text.lstrip()
    if rest.startswith(START):
        return len(text) - len(rest) + len(START)
    return 0 if prompt_opens else None


def _partial_tag(text: str, tag: str) -> int:
    """How long a suffix of text could still begin tag: that much is held back."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ReasoningStream:
    """The streaming side: feed it text deltas, then finish; it holds back only what could still be a tag."""

    def __init__(self, prompt_opens: bool) -> None:
        self._prompt_opens = prompt_opens
        self._mode = "lead"  # then "reasoning" or "content"; content is the last
        self._held = ""
        self._out: list[ReasoningDelta] = []
        self._finished = False

    @property
    def ended(self) -> bool:
        """Whether the reasoning is over (or there is none): what comes next is content."""
        return self._mode == "content"

    def feed(self, delta: str) -> list[ReasoningDelta]:
        """The pieces the text so far settles."""
        if self._finished:
            raise RuntimeError("expected feed before finish, found a feed after it")
        text, self._held = self._held + delta, ""
        if self._mode == "lead":
            text = self._in_lead(text)
        if self._mode == "reasoning":
            text = self._in_reasoning(text)
        if self._mode == "content":
            self._emit(text)
        return self._drain()

    def finish(self) -> list[ReasoningDelta]:
        """The pieces of what was held back, now that the text is complete."""
        if not self._finished:
            self._finished = True
            if self._mode == "lead":  # it never opened <think>
                self._mode = "reasoning" if self._prompt_opens else "content"
            self._emit(self._held)
            self._held = ""
        return self._drain()

    def _in_lead(self, text: str) -> str:
        if _undecided(text):
            self._held = text
            return ""
        start = _reasoning_start(text, self._prompt_opens)
        self._mode = "content" if start is None else "reasoning"
        return text[start or 0:]

    def _in_reasoning(self, text: str) -> str:
        end = text.find(END)
        if end >= 0:
            self._emit(text[:end])
            self._mode = "content"
            return text[end + len(END):]
        cut = len(text) - _partial_tag(text, END)
        self._emit(text[:cut])
        self._held = text[cut:]
        return ""

    def _emit(self, text: str) -> None:
        if text:
            content = self._mode == "content"
            self._out.append(ReasoningDelta(None if content else text, text if content else None))

    def _drain(self) -> list[ReasoningDelta]:
        out, self._out = self._out, []
        return out


class ReasoningParser:
    """<think>...</think> opening the output is reasoning, the rest content. Where the chat template opens <think>
    in the prompt (PROMPT_OPENS), the output before the first </think> is reasoning without an opening tag too."""
    PROMPT_OPENS = False

    def parse(self, text: str) -> ReasoningOutput:
        """The reasoning and content of a whole text; a reasoning never closed takes all the rest."""
        start = _reasoning_start(text, self.PROMPT_OPENS)
        if start is None:
            return ReasoningOutput(None, text or None)
        end = text.find(END, start)
        if end < 0:
            return ReasoningOutput(text[start:] or None, None)
        return ReasoningOutput(text[start:end] or None, text[end + len(END):] or None)

    def content_start(self, text: str) -> int | None:
        """Where the content begins in the text so far, or None while the output may still be reasoning."""
        if _undecided(text):
            return None
        start = _reasoning_start(text, self.PROMPT_OPENS)
        if start is None:
            return 0
        end = text.find(END, start)
        return None if end < 0 else end + len(END)

    def reasoning_ended(self, text: str) -> bool:
        """Whether the text so far has left the reasoning (or has none), so that what follows is content."""
        return self.content_start(text) is not None

    def stream(self) -> ReasoningStream:
        """A streaming parser for one output."""
        return ReasoningStream(self.PROMPT_OPENS)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only where the output opens with <think>; an output that does not (enable_thinking off,
    whose template closes an empty <think></think> in the prompt) is all content."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: its template opens <think> in the prompt, so the output starts inside the reasoning; an opening
    tag the model writes anyway is dropped, and without </think> the whole output is reasoning."""
    PROMPT_OPENS = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser that vLLM's --reasoning-parser NAME selects, so that a server flag can name it the same way."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(sorted(REASONING_PARSERS))}, got {name!r}")
    return REASONING_PARSERS[name]()
