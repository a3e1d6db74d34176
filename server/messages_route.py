"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat route's machinery
(server/messages_request.py reads the request as a chat completion, server/messages_output.py writes the answer),
whole or streamed. Errors are the server's error objects, which also have Anthropic's shape (`"type": "error"`)."""

import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pegainfer.errors import RequestError
from pegainfer.runtime.engine_loop import EngineDead
from pegainfer.server import responses as schema
from pegainfer.server.errors import ApiError
from pegainfer.server.generation import Choice
from pegainfer.server.messages_output import MessageEvents, message_object, new_id, usage, whole_content
from pegainfer.server.messages_request import RENAMED, CountTokensRequest, MessagesRequest, to_chat
from pegainfer.server.prepare import Prepared, prepare_chat
from pegainfer.server.respond import merged, run_whole

if TYPE_CHECKING:
    from pegainfer.server.app import ServerContext

STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "description": "server-sent events: message_start, content_block_start, content_block_delta, "
                   "content_block_stop, message_delta and message_stop, each as JSON in its data, its type also in "
                   "its event field",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}


def add_messages_routes(app: FastAPI, ctx: "ServerContext") -> None:
    errors = schema.error_responses(400, 401, 404, 413, 415, 503)

    @app.post("/v1/messages", response_model=None,
              responses={200: {"model": schema.AnthropicMessage, "content": STREAM}, **errors})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        prepared = await prepare(ctx, body)
        if not ctx.engine.healthy:
            raise ApiError(503, f"the engine has failed: {ctx.engine.error}")
        message_id, engine_id = new_id(), f"msg-{uuid.uuid4().hex}"
        choices = [Choice(0)]
        model = prepared.lora or ctx.model_name
        single = bool((body.tool_choice or {}).get("disable_parallel_tool_use"))
        if body.stream:
            events = stream(ctx, prepared, engine_id, message_id, model, choices[0], single)
            return StreamingResponse(events, media_type="text/event-stream",
                                     background=BackgroundTask(events.aclose))
        if not await run_whole(ctx, request, prepared, engine_id, choices):
            return Response(status_code=499)
        content = whole_content(prepared.output, choices[0].text, single)
        counts = usage(len(prepared.prompts[0]), choices[0])
        return JSONResponse(message_object(message_id, model, content, choices[0], counts))

    @app.post("/v1/messages/count_tokens", response_model=schema.InputTokens,
              responses=schema.error_responses(400, 401, 404, 413, 415))
    async def count_tokens(body: CountTokensRequest) -> dict:
        return {"input_tokens": len((await prepare(ctx, body)).prompts[0])}


async def prepare(ctx: "ServerContext", body: MessagesRequest) -> Prepared:
    try:
        return await prepare_chat(ctx, to_chat(body))
    except ApiError as error:  # named as this route's request names it
        error.param = RENAMED.get(error.param, error.param)
        raise


async def stream(ctx: "ServerContext", prepared: Prepared, engine_id: str, message_id: str, model: str,
                 choice: Choice, single_call: bool) -> AsyncIterator[str]:
    """message_start goes with the first token, once the prefix cache's share of the prompt is known: its usage
    is the final one's split (cache reads apart), less the output."""
    events, parts = MessageEvents(single_call), prepared.output.stream()
    prompt_tokens, started = len(prepared.prompts[0]), False
    try:
        async for delta in merged(ctx, prepared, engine_id, [choice]):
            if not started:
                start = message_object(message_id, model, [], None, usage(prompt_tokens, choice) | {"output_tokens": 0})
                yield sse({"type": "message_start", "message": start})
                started = True
            pieces = parts.feed(delta.text) + (parts.finish() if delta.finish_reason else [])
            for piece in pieces:
                for event in events.feed(piece):
                    yield sse(event)
    except (EngineDead, RequestError) as error:
        kind = "api_error" if isinstance(error, EngineDead) else "invalid_request_error"
        yield sse({"type": "error", "error": {"type": kind, "message": str(error)}})
        return
    for event in events.end():
        yield sse(event)
    final = message_object(message_id, model, events.blocks, choice, usage(prompt_tokens, choice))
    delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
    yield sse({"type": "message_delta", "delta": delta, "usage": final["usage"]})
    yield sse({"type": "message_stop"})


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
