"""Request bodies of the OpenAI-compatible API, as pydantic models. Ranges live here, so that a bad value is
refused before anything runs, with the parameter's name (server/errors.py turns the validation error into an
OpenAI error object)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pegainfer.runtime.sampler import MAX_LOGPROBS

MAX_N = 16  # choices per prompt
MAX_STOP = 16  # stop strings per request

Prompt = str | list[str] | list[int] | list[list[int]]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields completions and chat share. Unknown fields are ignored, as OpenAI's own server does; known fields
    pegainfer does not implement are refused when set (server/app.py: UNSUPPORTED)."""
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
    # known, not implemented: refused unless left at their defaults
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        return stops


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

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

    def as_template_input(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)  # the older name of max_completion_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
