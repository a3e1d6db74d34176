"""Anthropic's Messages API request (POST /v1/messages, as vLLM and SGLang serve it), read as the chat completion
it amounts to: the system prompt as a system message, tool_use blocks as an assistant's tool calls, tool_result
blocks as tool messages, thinking blocks as the assistant's reasoning_content, tools' input_schema as parameters,
tool_choice any as required, thinking enabled or disabled as the template's enable_thinking."""

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pegainfer.server.errors import ApiError
from pegainfer.server.protocol import ChatCompletionRequest, chat_request

# the chat request's fields that this route's request names otherwise
RENAMED = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "chat_template_kwargs": "thinking"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # not Anthropic's: vLLM's, as on the other routes
    seed: int | None = Field(None, ge=0, lt=2**63)
    structured_outputs: dict[str, Any] | None = None
    # known, not implemented
    mcp_servers: list[Any] | None = None
    container: Any = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=1)  # counting generates nothing


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request the Messages request amounts to."""
    for name in ("mcp_servers", "container"):
        if getattr(body, name):
            raise ApiError(400, f"{name} is not supported by pegainfer: leave it out", name)
    prefill = is_prefill(body.messages[-1])
    fields: dict[str, Any] = {
        "model": body.model, "messages": system_messages(body.system) + chat_messages(body.messages),
        "max_completion_tokens": body.max_tokens, "stop": body.stop_sequences, "stream": body.stream,
        "add_generation_prompt": not prefill, "continue_final_message": prefill,
        "tools": chat_tools(body.tools) or None, "chat_template_kwargs": thinking(body.thinking),
        "structured_outputs": body.structured_outputs,
        **chat_tool_choice(body.tool_choice)}
    given = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "seed")
             if getattr(body, name) is not None}
    return chat_request({k: v for k, v in fields.items() if v is not None} | given)


def is_prefill(last: Any) -> bool:
    """A last assistant message that ends in text: the start of the answer, which the model continues."""
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return False
    content = last.get("content")
    return isinstance(content, str) or (isinstance(content, list) and bool(content) and
                                        isinstance(content[-1], dict) and content[-1].get("type") == "text")


def system_messages(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    return [{"role": "system", "content": system if isinstance(system, str) else _texts(system, "system")}]


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message's blocks as chat messages: a user message's tool results as tool messages before its text, an
    assistant message's thinking, text and tool uses as one assistant message."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role, content = (message.get("role"), message.get("content")) if isinstance(message, dict) else (None, None)
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages[{index}].role must be user or assistant, found {role!r}", "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise ApiError(400, f"messages[{index}].content must be a string or a list of blocks", "messages")
        elif role == "user":
            out += _user_blocks(content, index)
        else:
            out.append(_assistant_blocks(content, index))
    return out


def _user_blocks(blocks: list[Any], index: int) -> list[dict[str, Any]]:
    tools, texts = [], []
    for block in blocks:
        kind = _kind(block, index)
        if kind == "tool_result":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _texts(result, f"messages[{index}]")
            tools.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", index),
                          "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind == "text":
            texts.append(_string(block, "text", index))
        else:
            _refuse(kind, index)
    return tools + ([{"role": "user", "content": "\n".join(texts)}] if texts or not tools else [])


def _assistant_blocks(blocks: list[Any], index: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for block in blocks:
        kind = _kind(block, index)
        if kind == "text":
            message["content"] += _string(block, "text", index)
        elif kind == "thinking":
            message["reasoning_content"] = message.get("reasoning_content", "") + _string(block, "thinking", index)
        elif kind == "tool_use":
            if not isinstance(block.get("input", {}), dict):
                raise ApiError(400, f"messages[{index}]: a tool_use block's input must be an object", "messages")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            message.setdefault("tool_calls", []).append({"id": _string(block, "id", index), "type": "function",
                                                         "function": {"name": _string(block, "name", index),
                                                                      "arguments": arguments}})
        elif kind != "redacted_thinking":  # encrypted elsewhere: nothing a template can read
            _refuse(kind, index)
    return message


def _kind(block: Any, index: int) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ApiError(400, f'messages[{index}].content: each block is an object with a "type"', "messages")
    return block["type"]


def _refuse(kind: str, index: int) -> None:
    raise ApiError(400, f"messages[{index}]: blocks of type {kind!r} are not supported here; pegainfer runs the "
                        f"model's text stack and takes text, thinking, tool_use and tool_result blocks", "messages")


def _string(block: dict[str, Any], key: str, index: int) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"messages[{index}]: a {block['type']} block's {key} must be a string", "messages")
    return value


def _texts(blocks: Any, where: str) -> str:
    """Text blocks' text, a line apart (a system prompt, a tool result)."""
    if not isinstance(blocks, list) or not all(isinstance(b, dict) and b.get("type") == "text"
                                               and isinstance(b.get("text"), str) for b in blocks):
        raise ApiError(400, f'{where}: expected a string or a list of {{"type": "text", "text": ...}} blocks',
                       "system" if where == "system" else "messages")
    return "\n".join(b["text"] for b in blocks)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Client tools ({name, description, input_schema}) as chat tools; Anthropic's server tools are refused."""
    out = []
    for index, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            raise ApiError(400, f"tools[{index}]: pegainfer runs client tools ({{name, description, input_schema}}) "
                                f"only", "tools")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        out.append({"type": "function", "function": function | ({"description": tool["description"]}
                                                                  if "description" in tool else {})})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> dict[str, Any]:
    """tool_choice auto, any (a call required), tool (that one), none; disable_parallel_tool_use."""
    if choice is None:
        return {}
    kind = choice.get("type")
    chosen = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ApiError(400, 'tool_choice {"type": "tool"} needs the tool\'s "name"', "tool_choice")
        chosen = {"type": "function", "function": {"name": choice["name"]}}
    if chosen is None:
        raise ApiError(400, 'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}',
                       "tool_choice")
    parallel = {"parallel_tool_calls": False} if choice.get("disable_parallel_tool_use") else {}
    return {"tool_choice": chosen} | parallel


def thinking(config: dict[str, Any] | None) -> dict[str, Any]:
    """thinking enabled (or adaptive) or disabled as a thinking template's enable_thinking, off where the request
    leaves it out, as Anthropic's is; its budget_tokens is not enforced: max_tokens bounds the thinking and the
    answer together."""
    if config is None:
        return {"enable_thinking": False}
    if config.get("type") not in ("enabled", "adaptive", "disabled"):
        raise ApiError(400, 'thinking must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}',
                       "thinking")
    return {"enable_thinking": config["type"] != "disabled"}
