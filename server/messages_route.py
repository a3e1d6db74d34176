"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat route's machinery
(server/messages_request.py reads the request as a chat completion, server/messages_output.py writes the answer),
whole or streamed. Errors are the server's error objects, which also have Anthropic's shape (`"type": "error"`)."""

import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pegainfer.errors import RequestError
from pegainfer.runtime.engine_loop import EngineDead
from pegainfer.server import responses as schema
from pegainfer.server.errors import params_renamed
from pegainfer.server.generation import Choice
from pegainfer.server.messages_output import MessageEvents, message_object, new_id, usage, whole_content
from pegainfer.server.messages_request import RENAMED, CountTokensRequest, MessagesRequest, to_chat
from pegainfer.server.prepare import Prepared, prepare_chat
from pegainfer.server.respond import event_stream, merged, require_healthy, run_whole, typed_sse

if TYPE_CHECKING:
    from pegainfer.server.app import ServerContext

STREAM = schema.event_stream("message_start, content_block_start, content_block_delta, content_block_stop, "
                             "message_delta and message_stop, each as JSON in its data, its type also in its event "
                             "field")


def add_messages_routes(app: FastAPI, ctx: "ServerContext") -> None:
    errors = schema.error_responses(400, 401, 404, 413, 415, 503)

    @app.post("/v1/messages", response_model=None,
              responses={200: {"model": schema.AnthropicMessage, "content": STREAM}, **errors})
    async def messages(body: MessagesRequest, request: Request) -> Response:
        prepared = await prepare(ctx, body)
        require_healthy(ctx)
        message_id, engine_id = new_id(), f"msg-{uuid.uuid4().hex}"
        choices = [Choice(0)]
        model = prepared.lora or ctx.model_name
        single = bool((body.tool_choice or {}).get("disable_parallel_tool_use"))
        if body.stream:
            return event_stream(stream(ctx, prepared, engine_id, message_id, model, choices[0], single))
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
    with params_renamed(RENAMED):
        return await prepare_chat(ctx, to_chat(body))


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
                yield typed_sse({"type": "message_start", "message": start})
                started = True
            for piece in parts.take(delta.text, delta.finish_reason is not None):
                for event in events.feed(piece):
                    yield typed_sse(event)
    except (EngineDead, RequestError) as error:
        kind = "api_error" if isinstance(error, EngineDead) else "invalid_request_error"
        yield typed_sse({"type": "error", "error": {"type": kind, "message": str(error)}})
        return
    for event in events.end():
        yield typed_sse(event)
    final = message_object(message_id, model, events.blocks, choice, usage(prompt_tokens, choice))
    delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
    yield typed_sse({"type": "message_delta", "delta": delta, "usage": final["usage"]})
    yield typed_sse({"type": "message_stop"})
