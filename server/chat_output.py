"""A chat choice's text as its message: the reasoning split off by the server's reasoning parser
(`reasoning_content`, and vLLM's newer `reasoning`), then tool calls parsed from the rest by its tool-call parser
when the request's tool choice allows calls (`tool_calls`, finish_reason "tool_calls"); whole, or delta by delta for
a stream, the two agreeing."""

from dataclasses import dataclass
from typing import Any

from pegainfer.server.reasoning import reasoning_parser
from pegainfer.server.tool_parsers import ToolCall, tool_parser


@dataclass(frozen=True)
class ChatOutput:
    reasoning: str | None = None  # the reasoning parser's name, if the server has one
    tools: str | None = None  # the tool-call parser's name, where the request's tool choice allows calls
    named: bool = False  # a named tool choice: its call finishes with "stop", as OpenAI's does

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the message, whether it calls tools)."""
        reasoning, content = reasoning_parser(self.reasoning).parse(text) if self.reasoning else (None, text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message |= {"reasoning_content": reasoning, "reasoning": reasoning}
        if self.tools is None:
            return message, False
        parsed = tool_parser(self.tools).parse(content or "")
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = [_call(call) for call in parsed.tool_calls]
        return message, bool(parsed.tool_calls) and not self.named

    def stream(self) -> "ChatOutputStream":
        return ChatOutputStream(self)


def _call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ChatOutputStream:
    """Text deltas in, OpenAI delta objects out: reasoning pieces, content pieces, tool-call pieces."""

    def __init__(self, output: ChatOutput) -> None:
        self._reasoning = reasoning_parser(output.reasoning).stream() if output.reasoning else None
        self._tools = tool_parser(output.tools).stream() if output.tools else None
        self._named = output.named
        self.calls = False  # whether a tool call has been sent (and finishes the choice with "tool_calls")

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._content(text, final=False)
        return self._split(self._reasoning.feed(text), final=False)

    def take(self, text: str, last: bool) -> list[dict[str, Any]]:
        """The pieces a text delta settles; with `last` (the output's end), what was held back as well."""
        return self.feed(text) + (self.finish() if last else [])

    def finish(self) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return self._content("", final=True)
        return self._split(self._reasoning.finish(), final=True)

    def _split(self, pieces: list, final: bool) -> list[dict[str, Any]]:
        out = []
        for piece in pieces:
            if piece.reasoning is not None:
                out.append({"reasoning_content": piece.reasoning, "reasoning": piece.reasoning})
            else:
                out += self._content(piece.content or "", final=False)
        return out + (self._content("", final=True) if final else [])

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self._tools is None:
            return [{"content": text}] if text else []
        deltas = (self._tools.feed(text) if text else []) + (self._tools.finish() if final else [])
        self.calls = self.calls or (not self._named and any(d.index is not None for d in deltas))
        return [d.as_openai() for d in deltas]
