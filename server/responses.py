"""Response bodies of the API as pydantic models, for the OpenAPI document: server/openai_format.py builds the
bodies themselves as dicts, and the schema tests hold every response the server gives against these."""

from typing import Any, Literal

from pydantic import BaseModel

FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]  # "tool_calls": stopped after calling tools


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorDetail
    type: Literal["error"]  # Anthropic's error shape too, for /v1/messages clients


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # an echoed prompt's first token has none
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None  # the stop string or stop_token_ids id that ended it
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null where the answer is only tool calls
    reasoning_content: str | None = None  # with --reasoning-parser; `reasoning` is vLLM's newer name for it
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class ResponseObject(BaseModel):
    """The Responses API's answer (server/responses_output.py): output items of type reasoning, message and
    function_call."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    incomplete_details: dict[str, str] | None
    store: bool


class AnthropicMessage(BaseModel):
    """The Messages API's answer (server/messages_output.py): content blocks of type thinking, text and
    tool_use."""
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: dict[str, int]


class InputTokens(BaseModel):
    input_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class Detokenized(BaseModel):
    prompt: str


class Health(BaseModel):
    status: Literal["ok"]


class Version(BaseModel):
    version: str


ERROR_STATUSES = {400: "Bad input: the message names the parameter", 401: "Missing or wrong API key",
                  404: "No such model or route", 413: "Request body too large",
                  415: "Request body not sent as application/json", 503: "The engine has failed"}
def event_stream(description: str) -> dict[str, Any]:
    """The schema of one server-sent event (Open API before 3.2 has a stream's `schema` describe each event)."""
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "description": f"server-sent events: {description}",
        "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}


STREAM = event_stream("one chunk object of the route (a text_completion or chat.completion.chunk) as JSON in each "
                      "event's data, then data: [DONE]")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for the error statuses a route can answer, each with the error object's schema."""
    return {status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]} for status in statuses}
