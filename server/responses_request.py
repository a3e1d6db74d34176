"""OpenAI's Responses API request (POST /v1/responses), read as the chat completion it amounts to: its input items
as messages (a function call as an assistant's tool call, its output as a tool message, a reasoning item as the
next assistant message's reasoning_content), its flat function tools as chat tools, text.format as response_format,
reasoning.effort "none" as enable_thinking off. Nothing is stored: previous_response_id and background are refused,
and the answer says store false."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pegainfer.server.errors import ApiError
from pegainfer.server.protocol import MAX_LOGPROBS, ChatCompletionRequest, StreamOptions, chat_request

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# include values that ask for nothing pegainfer has (no encrypted reasoning; no hosted tools' results)
HARMLESS_INCLUDES = ("reasoning.encrypted_content",)
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # the openai client's ReasoningEffort


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    include: list[str] | None = None
    top_logprobs: int | None = Field(0, ge=0, le=MAX_LOGPROBS)
    # vLLM's extras that carry over to the chat request as they are
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(None, gt=0, le=10, allow_inf_nan=False)
    cache_salt: str | None = Field(None, min_length=1)
    structured_outputs: dict[str, Any] | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # known, not implemented
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = False
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None


def refused(body: ResponsesRequest) -> None:
    """A 400 naming the first field set to something pegainfer does not do."""
    for name in ("previous_response_id", "conversation"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name} needs stored responses, which pegainfer does not keep: send the whole "
                                f"conversation as input", name)
    if body.background:
        raise ApiError(400, "background responses are not supported by pegainfer: leave background out",
                       "background")
    if body.prompt is not None:
        raise ApiError(400, "prompt templates stored with OpenAI are not supported: send input", "prompt")
    if body.max_tool_calls is not None:
        raise ApiError(400, "max_tool_calls is not supported by pegainfer yet: leave it out", "max_tool_calls")
    for name in body.include or []:
        if name not in HARMLESS_INCLUDES:
            raise ApiError(400, f"include {name!r} is not supported by pegainfer yet", "include")
    if body.top_logprobs:
        raise ApiError(400, "logprobs are not supported on /v1/responses yet: use /v1/chat/completions",
                       "top_logprobs")


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request the Responses request amounts to."""
    refused(body)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + \
        input_messages(body.input)
    if not messages:
        raise ApiError(400, "input holds no message", "input")
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream,
        "tools": chat_tools(body.tools or []) or None, "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "max_completion_tokens": body.max_output_tokens,
        "seed": body.seed, "stop": body.stop, "ignore_eos": body.ignore_eos, "cache_salt": body.cache_salt,
        "user": body.user,
        "response_format": response_format(body.text), "structured_outputs": body.structured_outputs,
        "chat_template_kwargs": thinking(body.reasoning),
        "stream_options": StreamOptions(include_usage=True) if body.stream else None}
    given = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "repetition_penalty")
             if getattr(body, name) is not None}
    return chat_request({k: v for k, v in fields.items() if v is not None} | given)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive function calls become one assistant message's tool calls."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for index, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, index) | ({"reasoning_content": reasoning} if reasoning else {}))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", index), "type": "function",
                    "function": {"name": _text(item, "name", index), "arguments": _text(item, "arguments", index)}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning:  # a turn's message and calls: one message
                messages.append({"role": "assistant", "content": ""} |
                                ({"reasoning_content": reasoning} if reasoning else {}))
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", index),
                             "content": output if isinstance(output, str) else _parts(output, index)})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, index)
            continue
        else:
            raise ApiError(400, f"input[{index}]: items of type {kind!r} are not supported; pegainfer takes "
                                f"messages, function_call, function_call_output and reasoning items", "input")
        reasoning = None
    return messages


def _reasoning_text(item: dict[str, Any], index: int) -> str:
    """A reasoning item's text: its content's parts, else its summary's."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                              for p in parts):
        raise ApiError(400, f"input[{index}]: a reasoning item's content and summary are lists of "
                            f'{{"type": ..., "text": "..."}} parts', "input")
    return "".join(p["text"] for p in parts)


def _message(item: dict[str, Any], index: int) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "system", "developer", "assistant"):
        raise ApiError(400, f"input[{index}].role must be user, system, developer or assistant, found {role!r}",
                       "input")
    return {"role": role, "content": content if isinstance(content, str) else _parts(content, index)}


def _parts(parts: Any, index: int) -> str:
    """A content list's text; images and files are refused, as the chat route refuses them."""
    if not isinstance(parts, list):
        raise ApiError(400, f"input[{index}].content must be a string or a list of text parts", "input")
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise ApiError(400, f"input[{index}]: content parts of type {kind!r} are not supported: this server "
                                f"runs the model's text stack only", "input")
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts)


def _text(item: dict[str, Any], key: str, index: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"input[{index}].{key} must be a string", "input")
    return value


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses API's flat function tools ({type, name, description, parameters, strict}) as chat tools."""
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ApiError(400, f"tools[{index}]: tools of type {kind!r} are not supported; pegainfer runs "
                                f"function tools only", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """{"type": "function", "name": N} as chat's {"type": "function", "function": {"name": N}}."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format: json_schema's fields sit flat in the Responses API."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, 'text.format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                            '"json_schema", "name": ..., "schema": {...}}', "text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def thinking(reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
    """reasoning.effort "none" turns a thinking template's thinking off; any other effort leaves it on."""
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise ApiError(400, f"reasoning.effort must be one of {', '.join(EFFORTS)}, found {effort!r}", "reasoning")
    return {"enable_thinking": effort != "none"}
