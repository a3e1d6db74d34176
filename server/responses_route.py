"""POST /v1/responses: OpenAI's Responses API over the chat route's machinery (server/responses_request.py reads
the request as a chat completion, server/responses_output.py writes the answer), whole or streamed."""

import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pegainfer.errors import RequestError
from pegainfer.runtime.engine_loop import EngineDead
from pegainfer.server import responses as schema
from pegainfer.server.errors import ContextTooLong, params_renamed
from pegainfer.server.generation import Choice
from pegainfer.server.prepare import Prepared, prepare_chat
from pegainfer.server.respond import event_stream, merged, require_healthy, run_whole, typed_sse
from pegainfer.server.responses_output import (ResponseEvents, new_id, response_object, status_of, usage,
                                               whole_items)
from pegainfer.server.responses_request import ResponsesRequest, to_chat

if TYPE_CHECKING:
    from pegainfer.server.app import ServerContext

# the chat request's fields that this route's request names otherwise
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
           "chat_template_kwargs": "reasoning", "truncate_prompt_tokens": "truncation"}
STREAM = schema.event_stream("each a typed Responses API event (response.created, response.output_item.added, "
                             "response.output_text.delta, ..., response.completed) as JSON in its data, its type "
                             "also in its event field")


def add_responses_routes(app: FastAPI, ctx: "ServerContext") -> None:
    errors = schema.error_responses(400, 401, 404, 413, 415, 503)

    @app.post("/v1/responses", response_model=None,
              responses={200: {"model": schema.ResponseObject, "content": STREAM}, **errors})
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        with params_renamed(RENAMED):
            prepared = await prepare(ctx, body)
        require_healthy(ctx)
        response_id = f"resp_{body.request_id}" if body.request_id else new_id("resp")
        engine_id = f"resp-{uuid.uuid4().hex}"
        choices = [Choice(0)]
        model = prepared.lora or ctx.model_name
        if body.stream:
            return event_stream(stream(ctx, body, prepared, engine_id, response_id, model, choices[0]))
        if not await run_whole(ctx, request, prepared, engine_id, choices):
            return Response(status_code=499)
        status = status_of(choices[0])
        items, reasoning = whole_items(prepared.output, choices[0].text, status)
        counts = usage(ctx.tokenizer, len(prepared.prompts[0]), choices[0], reasoning)
        return JSONResponse(response_object(response_id, body, model, items, status, counts))


async def prepare(ctx: "ServerContext", body: ResponsesRequest) -> Prepared:
    """The request prepared as a chat request; with truncation auto, an input past the context loses its first
    turns (up to its next user message) until it fits, as OpenAI's does."""
    items = body.input
    while True:
        try:
            return await prepare_chat(ctx, to_chat(body.model_copy(update={"input": items})))
        except ContextTooLong:
            items = without_first_turn(items) if body.truncation == "auto" else None
            if not items:
                raise


def without_first_turn(items: str | list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The input less its first item and what follows it up to the next user message; None where nothing is left."""
    if isinstance(items, str):
        return None
    later = [i for i, item in enumerate(items) if i > 0 and isinstance(item, dict) and item.get("role") == "user"]
    return items[later[0]:] if later else None


async def stream(ctx: "ServerContext", body: ResponsesRequest, prepared: Prepared, engine_id: str,
                 response_id: str, model: str, choice: Choice) -> AsyncIterator[str]:
    events, parts = ResponseEvents(), prepared.output.stream()
    started = response_object(response_id, body, model, [], "in_progress", None)
    yield typed_sse(events.event("response.created", response=started))
    yield typed_sse(events.event("response.in_progress", response=started))
    try:
        async for delta in merged(ctx, prepared, engine_id, [choice]):
            for piece in parts.take(delta.text, delta.finish_reason is not None):
                for event in events.feed(piece):
                    yield typed_sse(event)
    except (EngineDead, RequestError) as error:
        yield typed_sse(events.event("error", code="engine_failed" if isinstance(error, EngineDead) else "bad_request",
                               message=str(error), param=None))
        return
    counts = usage(ctx.tokenizer, len(prepared.prompts[0]), choice, events.reasoning)
    final = response_object(response_id, body, model, [], status_of(choice), counts)
    for event in events.finish(final):
        yield typed_sse(event)
