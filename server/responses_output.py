"""The Responses API's answer: a chat choice's message (reasoning, content, tool calls) as output items (reasoning,
message, function_call), whole, or as the typed server-sent events of a stream (item added, text and argument
deltas, item done, response completed), the streamed items the same as the whole answer's."""

import time
import uuid
from typing import Any

from pegainfer.runtime.tokenizer import TextTokenizer
from pegainfer.server.chat_output import ChatOutput
from pegainfer.server.generation import Choice
from pegainfer.server.responses_request import ResponsesRequest

ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "temperature", "top_p", "tools",
          "tool_choice", "truncation", "user", "reasoning")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(response_id: str, body: ResponsesRequest, model: str, output: list[dict[str, Any]],
                    status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    """The response object; the request's settings echoed, as OpenAI's are; store false: nothing is kept."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": status,
            "model": model, "output": output, "usage": usage, "error": None, "previous_response_id": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "text": body.text or {"format": {"type": "text"}}, "store": False,
            **{name: getattr(body, name) for name in ECHOED}, "tools": body.tools or []}


def status_of(choice: Choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


def usage(tokenizer: TextTokenizer, prompt_tokens: int, choice: Choice, reasoning: str) -> dict[str, Any]:
    """Token counts; the reasoning's tokens counted by encoding its text (at most the output's)."""
    output = len(choice.token_ids)
    thought = min(len(tokenizer.encode(reasoning, add_special_tokens=False)), output) if reasoning else 0
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": prompt_tokens + output}


def whole_items(output: ChatOutput, text: str, status: str) -> tuple[list[dict[str, Any]], str]:
    """A whole answer's items (and its reasoning, for the usage): the stream's, from the text in one piece, so
    that the two never differ."""
    events, parts = ResponseEvents(), output.stream()
    for piece in parts.take(text, last=True):
        events.feed(piece)
    events.end(status)
    return events.items, events.reasoning


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseEvents:
    """A stream's events from the chat output stream's pieces: each event numbered; an item opened when its first
    piece comes, closed (its done events) when another kind of piece, or the end, comes. Whitespace before any
    message text is held: the "\n\n" a thinking model writes between its reasoning and its calls is no message."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # closed ones
        self.kind: str | None = None  # the open item's: reasoning, message or function_call
        self.item_id = ""
        self.text = ""  # the open item's text (or arguments)
        self.call: tuple[str, str] = ("", "")  # the open call's (call_id, name)
        self.held = ""  # whitespace not yet in a message
        self.reasoning = ""  # all the reasoning, for the usage

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def at(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.items)}

    def feed(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        if piece.get("reasoning_content"):
            self.reasoning += piece["reasoning_content"]
            return self._open("reasoning") + [self._delta("response.reasoning_text.delta",
                                                          piece["reasoning_content"])]
        if piece.get("content"):
            text = piece["content"]
            if self.kind != "message":
                if not (self.held + text).strip():
                    self.held += text
                    return []
                text, self.held = self.held + text, ""
            return self._open("message") + [self._delta("response.output_text.delta", text)]
        events = []
        for call in piece.get("tool_calls") or []:
            if "id" in call:  # a new call: its id and name come first
                events += self._open("function_call", (call["id"], call["function"].get("name", "")))
            arguments = call["function"].get("arguments") or ""
            if arguments:
                self.text += arguments
                events.append(self.event("response.function_call_arguments.delta", **self.at(), delta=arguments))
        return events

    def _delta(self, kind: str, text: str) -> dict[str, Any]:
        self.text += text
        fields = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return self.event(kind, **self.at(), content_index=0, delta=text, **fields)

    def _open(self, kind: str, call: tuple[str, str] = ("", "")) -> list[dict[str, Any]]:
        if self.kind == kind and kind != "function_call":
            return []
        events = self._close("completed")
        self.kind, self.text, self.call, self.held = kind, "", call, ""
        self.item_id = new_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        events.append(self.event("response.output_item.added", output_index=len(self.items),
                                 item=self._item("in_progress", None)))
        if kind != "function_call":
            events.append(self.event("response.content_part.added", **self.at(), content_index=0,
                                     part=self._part("")))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        if self.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", **self.at(), name=self.call[1],
                                 arguments=self.text)]
        else:
            done = "response.reasoning_text.done" if self.kind == "reasoning" else "response.output_text.done"
            events = [self.event(done, **self.at(), content_index=0, text=self.text,
                                 **({"logprobs": []} if self.kind == "message" else {})),
                      self.event("response.content_part.done", **self.at(), content_index=0,
                                 part=self._part(self.text))]
        item = self._item(status, self.text)
        events.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.kind = None
        return events

    def _item(self, status: str, text: str | None) -> dict[str, Any]:
        if self.kind == "reasoning":
            return reasoning_item(self.item_id, text, status)
        if self.kind == "message":
            return message_item(self.item_id, text, status)
        return call_item(self.item_id, *self.call, text or "", status)

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": text} if self.kind == "reasoning" else output_text(text)

    def end(self, status: str) -> list[dict[str, Any]]:
        """The open item closed with the answer's status (a cut-off item is incomplete, as the response is); an
        answer with no item at all gets its (empty) message."""
        held, events = self.held, [] if self.items or self.kind else self._open("message")
        if events and held:
            events.append(self._delta("response.output_text.delta", held))
        return events + self._close(status)

    def finish(self, response: dict[str, Any]) -> list[dict[str, Any]]:
        """The end, then response.completed with every item, whatever its status says (as vLLM ends a stream: the
        openai client's stream helper waits for that event alone)."""
        events = self.end(response["status"])
        response["output"] = self.items
        return events + [self.event("response.completed", response=response)]
