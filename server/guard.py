"""What every request passes before the API sees it: the API key, the body size limit, a JSON media type (415
otherwise, so that a web page cannot make a browser post to a server on localhost: browsers send text/plain and
form bodies without asking), and a body that is strict UTF-8 JSON with no lone surrogate in any string. An ASGI
wrapper rather than FastAPI dependencies, so that a bad request is refused before its body is parsed or held whole,
and every refusal is an OpenAI error object."""

import hmac
import json
import re
from typing import Any

from pegainfer.server.errors import error_body

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json"})  # open with --api-key too
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class Guard:
    def __init__(self, app, ctx) -> None:
        self.app, self.ctx = app, ctx
        self.state = app.state  # tests and uvicorn reach the FastAPI app's state through the wrapper

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.ctx.api_key is not None and scope["path"] not in PUBLIC_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            anthropic = headers.get(b"x-api-key", b"").decode("latin-1")  # how Anthropic's clients send it
            if not (hmac.compare_digest(given.encode(), f"Bearer {self.ctx.api_key}".encode()) or
                    hmac.compare_digest(anthropic.encode(), self.ctx.api_key.encode())):
                return await reply(send, 401, "invalid API key: send the server's --api-key as "
                                              "'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                                   code="invalid_api_key")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.ctx.max_request_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _too_large(send, f"{declared.decode()} bytes", limit)
        media = headers.get(b"content-type", b"").decode("latin-1")
        if not is_json_media_type(media):
            return await reply(send, 415, f"the request body must be JSON sent as Content-Type: application/json, "
                                          f"found {media or 'no Content-Type'}", code="unsupported_media_type")
        chunks, size, more = [], 0, True
        while more:  # chunks joined once at the end: += would copy the growing body at every chunk
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > limit:
                return await _too_large(send, f"more than {limit} bytes", limit)
        body = b"".join(chunks)
        problem = body_problem(body)
        if problem is not None:
            return await reply(send, 400, problem[0], param=problem[1])
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect
        await self.app(scope, replay, send)


def is_json_media_type(value: str) -> bool:
    """application/json or application/*+json, parameters such as charset allowed (what FastAPI itself takes)."""
    kind = value.split(";", 1)[0].strip().lower()
    main, _, sub = kind.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def body_problem(body: bytes) -> tuple[str, str | None] | None:
    """(message, param) for a body that is not strict UTF-8 or that holds a lone surrogate; None when fine. The JSON
    itself is FastAPI's to parse (its errors become error objects too): it is parsed here only when a surrogate
    escape is there to find, so a large body costs one parse."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as error:
        return f"the request body is not valid UTF-8: byte 0x{body[error.start]:02x} at offset {error.start}", None
    if not _SURROGATE_ESCAPE.search(body):  # only \uXXXX escapes can make one: strict UTF-8 cannot carry surrogates
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None  # not JSON: FastAPI says so
    where = lone_surrogate(value)
    if where is None:
        return None
    return (f"{where or 'the request body'}: a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
            f"escape), which is not a character: send valid Unicode", where or None)


def lone_surrogate(value: Any) -> str | None:
    """The parameter path (messages[0].content) of the first string or key holding a lone surrogate, or None."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str) and not _encodes(item):
            return path
        if isinstance(item, dict):
            for key, child in item.items():
                name = key if _encodes(key) else key.encode("utf-8", "backslashreplace").decode()
                child_path = f"{path}.{name}" if path else name
                if name is not key:
                    return child_path
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _too_large(send, size: str, limit: int) -> None:
    await reply(send, 413, f"the request body has {size}; this server takes at most {limit} bytes "
                           f"(--max-request-bytes)", code="request_too_large")


async def reply(send, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
    payload = json.dumps(error_body(status, message, param, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
