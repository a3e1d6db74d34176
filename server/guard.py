"""What every request passes before the API sees it: the API key on /v1 routes, and the body size limit. An ASGI
wrapper rather than FastAPI dependencies, so that a request with a bad key is refused before its body is parsed,
and an oversized body is refused before it is held in memory whole."""

import hmac
import json

from pegainfer.server.errors import error_body


class Guard:
    def __init__(self, app, ctx) -> None:
        self.app, self.ctx = app, ctx
        self.state = app.state  # tests and uvicorn reach the FastAPI app's state through the wrapper

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.ctx.api_key is not None and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.ctx.api_key}".encode()):
                return await _reply(send, 401, "invalid API key: send the server's --api-key as "
                                               "'Authorization: Bearer KEY'", code="invalid_api_key")
        limit = self.ctx.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _too_large(send, f"{declared.decode()} bytes", limit)
        body, more = b"", True
        while more and scope["method"] in ("POST", "PUT", "PATCH"):
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await _too_large(send, f"more than {limit} bytes", limit)
        if scope["method"] == "POST" and not dict(scope["headers"]).get(b"content-type", b"").startswith(
                b"application/json"):
            # every POST route takes JSON: read it as such whatever a client such as curl -d declared
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the client's disconnect
        await self.app(scope, replay, send)


async def _too_large(send, size: str, limit: int) -> None:
    await _reply(send, 413, f"the request body has {size}; this server takes at most {limit} bytes "
                            f"(--max-request-bytes)", code="request_too_large")


async def _reply(send, status: int, message: str, code: str) -> None:
    payload = json.dumps(error_body(status, message, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
