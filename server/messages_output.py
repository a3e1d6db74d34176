"""The Messages API's answer: a chat choice's output (thinking, text, tool calls) as content blocks (thinking, text,
tool_use), whole, or as the events of a stream (message_start, content_block_start / _delta / _stop, message_delta,
message_stop); the whole answer's blocks are built by the same machinery from the text in one piece."""

import json
import uuid
from typing import Any

from pegainfer.server.chat_output import ChatOutput
from pegainfer.server.generation import Choice

DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
          "tool_use": ("input_json_delta", "partial_json")}


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def message_object(message_id: str, model: str, content: list[dict[str, Any]], choice: Choice | None,
                   usage: dict[str, int]) -> dict[str, Any]:
    """The message; a choice that has not ended (a stream's message_start) has no stop_reason yet."""
    reason, sequence = stop_reason(choice, content) if choice is not None else (None, None)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage}


def stop_reason(choice: Choice, content: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): max_tokens, a stop sequence found, a tool called, or the turn's end."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return ("tool_use" if any(b["type"] == "tool_use" for b in content) else "end_turn"), None


def usage(prompt_tokens: int, choice: Choice) -> dict[str, int]:
    """Anthropic counts cache reads apart from the input tokens."""
    return {"input_tokens": prompt_tokens - choice.num_cached_tokens, "output_tokens": len(choice.token_ids),
            "cache_read_input_tokens": choice.num_cached_tokens, "cache_creation_input_tokens": 0}


def whole_content(output: ChatOutput, text: str, single_call: bool) -> list[dict[str, Any]]:
    events, parts = MessageEvents(single_call), output.stream()
    for piece in parts.take(text, last=True):
        events.feed(piece)
    events.end()
    return events.blocks


class MessageEvents:
    """Content blocks from the chat output stream's pieces, with their events: a block started at its first piece,
    stopped when another kind of piece or the end comes. Whitespace before any text is held: the "\\n\\n" a
    thinking model writes between its thinking and its tool calls is no text block."""

    def __init__(self, single_call: bool = False) -> None:
        self.single_call = single_call  # disable_parallel_tool_use: a call past the first is dropped
        self.blocks: list[dict[str, Any]] = []  # every block started, the open one last
        self.open = False
        self.held = ""
        self.arguments = ""  # the open tool_use block's JSON so far

    def feed(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        if piece.get("reasoning_content"):
            return self._start({"type": "thinking", "thinking": "", "signature": ""}) + \
                self._delta(piece["reasoning_content"])
        if piece.get("content"):
            text = piece["content"]
            if not self._is("text"):
                if not (self.held + text).strip():
                    self.held += text
                    return []
                text, self.held = self.held + text, ""
            return self._start({"type": "text", "text": ""}) + self._delta(text)
        events = []
        for call in piece.get("tool_calls") or []:
            if self.single_call and call.get("index", 0) > 0:
                continue
            if "id" in call:  # a new call: its id and name come first
                events += self._start({"type": "tool_use", "id": call["id"],
                                       "name": call["function"].get("name", ""), "input": {}}, new=True)
            events += self._delta(call["function"].get("arguments") or "")
        return events

    def _is(self, kind: str) -> bool:
        return self.open and self.blocks[-1]["type"] == kind

    def _start(self, block: dict[str, Any], new: bool = False) -> list[dict[str, Any]]:
        if self._is(block["type"]) and not new:
            return []
        events = self._stop()
        self.blocks.append(block)
        self.open, self.held, self.arguments = True, "", ""
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        block = self.blocks[-1]
        kind, key = DELTAS[block["type"]]
        if block["type"] == "tool_use":
            self.arguments += text
        else:
            block[block["type"]] += text
        return [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": {"type": kind, key: text}}]

    def _stop(self) -> list[dict[str, Any]]:
        if not self.open:
            return []
        if self.blocks[-1]["type"] == "tool_use":
            self.blocks[-1]["input"] = tool_input(self.arguments)
        self.open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def end(self) -> list[dict[str, Any]]:
        """The open block stopped; an answer with no block at all gets its (possibly empty) text block."""
        if self.blocks:  # whitespace after the last block is no part of it
            return self._stop()
        held = self.held
        return self._start({"type": "text", "text": ""}) + self._delta(held) + self._stop()


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object a tool_use block's input is; text that is no JSON object is kept whole
    under "arguments" rather than lost."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}
