"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}, "type": "error"}` (Anthropic's
shape too) with the HTTP status, for every way a request can go wrong, so that a client library raises its usual
exception with a message that names the parameter."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         500: "server_error", 503: "server_error"}
ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages",
          "POST /v1/messages/count_tokens", "GET /v1/models", "GET /v1/models/{model}",
          "POST /tokenize", "POST /detokenize", "GET /tokenizer_info", "GET /health", "GET /metrics", "GET /version",
          "GET /openapi.json")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ContextTooLong(ApiError):
    """A prompt (with the tokens asked for) past the context length: a 400, which /v1/responses's truncation auto
    answers by dropping the input's first turns."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(400, message, param)


@contextmanager
def params_renamed(names: dict[str, str]) -> Iterator[None]:
    """An ApiError raised inside names its parameter as `names` maps it: a route whose request names the chat
    request's fields otherwise."""
    try:
        yield
    except ApiError as error:
        error.param = names.get(error.param, error.param)
        raise


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, with Anthropic's `"type": "error"` beside it (Anthropic clients read that shape)."""
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code if code is not None else status}, "type": "error"}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error.status, error.message, error.param, error.code), status_code=error.status)


async def api_error_handler(request: Request, error: ApiError) -> JSONResponse:
    return error_response(error)


async def http_error_handler(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, a method the route does not take) as OpenAI error objects."""
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}: this server has {', '.join(ROUTES)}"
    elif error.status_code == 405:
        allowed = error.headers.get("Allow", "") if error.headers else ""
        message = f"{request.url.path} does not take {request.method}: use {allowed or 'another method'}"
    elif isinstance(error.__cause__, RecursionError):
        message = "the request body could not be parsed: its JSON is nested too deeply"
    else:
        message = str(error.detail)
    response = error_response(ApiError(error.status_code, message, None, error.status_code))
    if error.headers:
        response.headers.update(error.headers)
    return response


async def internal_error_handler(request: Request, error: Exception) -> JSONResponse:
    """A bug: still an error object (the traceback goes to the log, where Starlette sends it)."""
    return error_response(ApiError(500, f"internal error: {type(error).__name__}: {error}"))


async def validation_error_handler(request: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(error.errors()))


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """The first problem pydantic found, as a 400 naming its parameter (messages[0].content, temperature...)."""
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON ({detail})")
    loc = [part for part in first["loc"] if part != "body"]
    if not loc:
        return ApiError(400, f"the request body must be a JSON object: {first['msg']}")
    param = _param(loc)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        return ApiError(400, f"{param} is required", param)
    got = first.get("input")
    shown = f" (got {got!r})" if not isinstance(got, dict | list) or len(repr(got)) < 80 else ""
    return ApiError(400, f"{param}: {message}{shown}", param)


def _param(loc: list) -> str:
    """body.messages.0.content -> messages[0].content; pydantic's union member tags (str, list[int]) left out."""
    param = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS and part[0].islower():
            param += f".{part}"
    return param
