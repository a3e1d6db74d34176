"""Request bodies of the OpenAI-compatible API, as pydantic models. Ranges live here, so that a bad value is
refused before anything runs, with the parameter's name (server/errors.py turns the validation error into an
OpenAI error object)."""

import json
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from pegainfer.runtime.sampler import MAX_LOGPROBS
from pegainfer.server.errors import ApiError

MAX_N = 16  # choices per prompt
MAX_STOP = 16  # stop strings per request
MAX_BAD_WORD = 200  # characters of a bad word (encoded on the event loop)

Prompt = str | list[str] | list[int] | list[list[int]]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class _Sampling(BaseModel):
    """Fields completions and chat share. Unknown fields are ignored, as vLLM does; known fields pegainfer does
    not implement are refused unless their value means nothing (UNUSED below)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    best_of: int | None = None
    # penalties (ir/ops/penalties.py): logit_bias's ids are checked against the vocabulary in server/prepare.py
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, le=10, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    bad_words: list[str] | None = Field(None, max_length=64)  # vLLM's: words the output may not contain
    allowed_token_ids: list[int] | None = Field(None, min_length=1)  # vLLM's: the only ids a token may be
    # vLLM's text and token options (server/generation.py's TextOptions, server/openai_format.py)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # a fast tokenizer's decoding (all pegainfer loads) ignores it
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the prompt's last k tokens; -1: the context
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N"
    return_token_ids: bool = False  # the prompt's and each choice's token ids beside the text
    request_id: str | None = Field(None, min_length=1, max_length=256)  # the answer's id, after its cmpl- prefix
    cache_salt: str | None = Field(None, min_length=1)  # prefix-cache hits only among requests with this salt
    # known, not implemented: refused unless their value means nothing (UNUSED)
    guided_decoding_backend: Any = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0
    logits_processors: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # runtime/prompt_logprobs.py
    # structured outputs (server/structured.py): one of these at a time
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("bad_words")
    @classmethod
    def _short_words(cls, value: list[str] | None) -> list[str] | None:
        if value and max(len(word) for word in value) > MAX_BAD_WORD:
            raise ValueError(f"each bad word at most {MAX_BAD_WORD} characters, found {max(map(len, value))}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        return stops


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)  # 0: score the prompt (echo), generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # the tokenizer's own (a BOS) around a text prompt
    prompt_embeds: Any = None  # known, not implemented (UNUSED)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        ok = isinstance(value, str) or (isinstance(value, list) and value and (
            all(isinstance(v, str) for v in value) or all(_is_id(v) for v in value)
            or all(isinstance(v, list) and v and all(_is_id(t) for t in v) for v in value)))
        if not ok:
            raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists "
                             "of token ids, none of them empty")
        return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may read more keys (name, tool_calls, ...)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """Images, audio and files: pegainfer serves a model's text stack (frontends/text_stack.py), no encoder."""
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in (None, "text"):
                raise ValueError(f"content parts of type {kind!r} are not supported: this server runs the model's "
                                 f"text stack only, so a message's content must be text")
        return value

    def as_template_input(self) -> dict[str, Any]:
        """The message as templates read it: text parts joined, and a tool call's JSON arguments as an object (as
        vLLM passes them: templates that write `arguments | tojson` would encode a string twice)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # the template gets the text as sent
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)  # the older name of max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open, for the answer to go on with it
    echo: bool = False  # the answer starts with the last message's content, where it has the answer's role
    add_special_tokens: bool = False  # the template writes its own
    documents: list[dict[str, Any]] | None = None  # for templates that read them (retrieval)
    chat_template_kwargs: dict[str, Any] | None = None
    # tool calls (server/tools.py): checked there, so that a malformed one gets a 400 naming it
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # known, not implemented: refused unless their value means nothing (UNUSED)
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    reasoning_effort: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    chat_template: str | None = None  # vLLM, too, takes one only from a server that trusts its clients' templates
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: StrictBool | None = None  # None: vLLM's defaults, true for a prompt, false for messages
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    tools: list[Any] | None = None  # as the chat route writes them into the template (server/tools.py checks)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class LoadLoraRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter."""
    lora_name: str = Field(min_length=1)


def _nothing(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value in (None, [], {})


# field -> whether a value means "nothing": such values are accepted, any other is refused with a 400 naming it.
# function_call "auto" means nothing without functions, which are refused (tools and tool_choice replace them).
UNUSED: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v in (None, ""),
    "functions": _empty, "guided_decoding_backend": lambda v: v in (None, "auto", "xgrammar"),
    "function_call": lambda v: v in (None, "none", "auto"), "modalities": lambda v: v in (None, ["text"]),
    **{name: _nothing for name in ("reasoning_effort", "audio", "prediction", "web_search_options", "prompt_embeds",
                                   "chat_template")},
    **{name: _empty for name in ("logits_processors", "kv_transfer_params", "vllm_xargs", "mm_processor_kwargs")},
    "use_beam_search": lambda v: v is False, "length_penalty": lambda v: v == 1.0, "priority": lambda v: v == 0,
}


def unused_field_set(body: BaseModel) -> str | None:
    """The first known-but-unimplemented field of the request set to a value that means something."""
    return next((name for name, unused in UNUSED.items()
                 if name in type(body).model_fields and not unused(getattr(body, name))), None)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request amounts to (/v1/responses, /v1/messages); what its checks find is a
    400 naming the chat field, which the route renames as its own request names it."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", str(first["loc"][0])) from None
