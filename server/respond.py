"""Running a prepared request on the engine loop and answering it: every choice at once, whole (one JSON body) or
streamed (server-sent events), with a client that leaves aborting its engine requests."""

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pegainfer.errors import RequestError
from pegainfer.runtime.engine_loop import EngineDead
from pegainfer.runtime.requests import EngineRequest
from pegainfer.server import openai_format as fmt
from pegainfer.server.chat_output import ChatOutputStream
from pegainfer.server.errors import ApiError, error_body
from pegainfer.server.generation import Choice, Delta, run_choice
from pegainfer.server.prepare import Prepared
from pegainfer.server.protocol import _Sampling

if TYPE_CHECKING:
    from pegainfer.server.app import ServerContext


async def merged(ctx: "ServerContext", prepared: Prepared, prefix: str,
                 choices: list[Choice]) -> AsyncIterator[Delta]:
    """Every choice of every prompt at once; deltas in the order tokens arrive."""
    queue: asyncio.Queue = asyncio.Queue()
    n = len(prepared.params) // len(prepared.prompts)

    async def pump(index: int) -> None:
        prompt = prepared.prompts[index // n]
        constraint = prepared.constraint(prompt) if prepared.constraint is not None else None
        request = EngineRequest(f"{prefix}-{index}", prompt, prepared.params[index], prepared.stop_token_ids,
                                group=prefix, constraint=constraint, lora=prepared.lora,
                                cache_salt=prepared.cache_salt)
        try:
            async for delta in run_choice(ctx.engine, request, ctx.tokenizer, prepared.text, index, ctx.metrics,
                                          choices[index]):
                queue.put_nowait(delta)
            queue.put_nowait(None)
        except Exception as error:  # noqa: BLE001  handed to the consumer, which answers with it
            queue.put_nowait(error)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(choices))]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def require_healthy(ctx: "ServerContext") -> None:
    if not ctx.engine.healthy:
        raise ApiError(503, f"the engine has failed: {ctx.engine.error}")


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """Server-sent events, closed (the engine's requests aborted) when the client leaves."""
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose))


async def respond(ctx: "ServerContext", request: Request, body: _Sampling, prepared: Prepared, *, chat: bool,
                  echo: list[str], top: int | None) -> Response:
    require_healthy(ctx)
    kind = "chatcmpl" if chat else "cmpl"
    engine_id = f"{kind}-{uuid.uuid4().hex}"  # unique whatever request_id a client sends
    answer_id = f"{kind}-{body.request_id}" if body.request_id else engine_id
    choices = [Choice(i) for i in range(len(prepared.params))]
    if body.stream:
        return event_stream(stream_events(ctx, prepared, body, engine_id, answer_id, choices, chat, echo, top))
    if not await run_whole(ctx, request, prepared, engine_id, choices):
        return Response(status_code=499)
    if prepared.score_only:  # max_tokens 0: the prompt's logprobs alone
        for choice in choices:
            choice.text, choice.token_ids, choice.logprobs, choice.finish_reason = "", [], [], "length"
    return JSONResponse(whole_answer(ctx, prepared, body, answer_id, choices, chat, echo, top))


async def run_whole(ctx: "ServerContext", request: Request, prepared: Prepared, engine_id: str,
                    choices: list[Choice]) -> bool:
    """Runs every choice to its end; False where the client left first (its requests aborted, their KV blocks
    freed, nobody to answer). An engine's error is raised as the API error it means."""
    task = asyncio.ensure_future(_drain(merged(ctx, prepared, engine_id, choices)))
    watcher = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False
    raise_engine_errors(task.exception())
    return True


def whole_answer(ctx: "ServerContext", prepared: Prepared, body: _Sampling, answer_id: str, choices: list[Choice],
                 chat: bool, echo: list[str], top: int | None) -> dict[str, Any]:
    base = fmt.envelope(answer_id, "chat.completion" if chat else "text_completion", prepared.lora or ctx.model_name)
    names, n = fmt.TokenNames(ctx.tokenizer, body.return_tokens_as_token_ids), body.n
    if chat:
        body_choices = [fmt.chat_choice(names, c, top, prepared.output, prepared.echo_message,
                                        body.return_token_ids) for c in choices]
        base |= fmt.prompt_logprobs_field(ctx.tokenizer, choices[0], prepared.prompts[0], body.prompt_logprobs)
        base |= {"prompt_token_ids": prepared.prompts[0]} if body.return_token_ids else {}
    else:
        body_choices = [fmt.completion_choice(names, c, echo[c.index // n], top is not None,
                                              prepared.prompts[c.index // n], body.prompt_logprobs,
                                              body.return_token_ids)
                        for c in choices]
    prompt_tokens = sum(len(ids) for ids in prepared.prompts)
    return {**base, "choices": body_choices, "usage": fmt.usage(prompt_tokens, choices, n)}


async def _drain(deltas: AsyncIterator[Delta]) -> None:
    async for _ in deltas:
        pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def raise_engine_errors(error: BaseException | None) -> None:
    if error is None:
        return
    if isinstance(error, EngineDead):
        raise ApiError(503, str(error))
    if isinstance(error, RequestError):
        raise ApiError(400, str(error))
    raise error


async def stream_events(ctx: "ServerContext", prepared: Prepared, body: _Sampling, engine_id: str, answer_id: str,
                        choices: list[Choice], chat: bool, echo: list[str], top: int | None) -> AsyncIterator[str]:
    base = fmt.envelope(answer_id, "chat.completion.chunk" if chat else "text_completion",
                        prepared.lora or ctx.model_name)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and body.stream_options.continuous_usage_stats
    prompt_tokens = sum(len(ids) for ids in prepared.prompts)
    if include_usage:
        base["usage"] = None
    names, n, ids = fmt.TokenNames(ctx.tokenizer, body.return_tokens_as_token_ids), body.n, body.return_token_ids
    if chat:
        for index in range(len(choices)):
            yield sse(fmt.chat_role_chunk(base, index) | ({"prompt_token_ids": prepared.prompts[0]} if ids else {}))
            if prepared.echo_message:
                yield sse(fmt.chat_chunk(names, base, Delta(index, "", -1, None, None, 0), None,
                                          {"content": prepared.echo_message}, None))
    started: set[int] = set()
    sent = 0  # tokens streamed: the choices run ahead of the stream
    outputs = [prepared.output.stream() for _ in choices] if chat else []
    try:
        async for delta in merged(ctx, prepared, engine_id, choices):
            sent += 1
            if not (delta.text or delta.finish_reason or delta.logprobs is not None or ids):
                continue  # held-back text with nothing else to say
            if chat:
                chunks = chat_chunks(names, base, delta, top, outputs[delta.index], ids)
            else:
                chunks = [completion_chunk(names, base, delta, prepared, echo, choices[delta.index],
                                           delta.index not in started, ids)]
            started.add(delta.index)
            for chunk in chunks:
                if continuous:
                    chunk["usage"] = fmt.usage(prompt_tokens, choices, n, sent)
                yield sse(_finished(chunk, delta, choices))
    except (EngineDead, RequestError) as error:
        status = 503 if isinstance(error, EngineDead) else 400
        yield sse(error_body(status, str(error)))
    else:
        if include_usage:
            yield sse({**base, "choices": [], "usage": fmt.usage(prompt_tokens, choices, n)})
    yield "data: [DONE]\n\n"


def completion_chunk(names: fmt.TokenNames, base: dict, delta: Delta, prepared: Prepared, echo: list[str],
                     choice: Choice, first: bool, ids: bool) -> dict:
    """A choice's chunk: its first with the echoed prompt, the prompt's logprobs where computed (and the prompt's
    ids, with return_token_ids)."""
    n = len(prepared.params) // len(prepared.prompts)
    prompt_ids, echoed = prepared.prompts[delta.index // n], echo[delta.index // n]
    prompt = None if choice.prompt_logprobs is None else (prompt_ids, choice.prompt_logprobs)
    chunk = fmt.completion_chunk(names, base, delta, echoed if first else "", len(echoed) + delta.offset, prompt)
    if ids:
        chunk["choices"][0] |= {"token_ids": [delta.token_id], **({"prompt_token_ids": prompt_ids} if first else {})}
    return chunk


def chat_chunks(names: fmt.TokenNames, base: dict, delta: Delta, top: int | None, output: ChatOutputStream,
                ids: bool) -> list[dict]:
    """A delta's chunks: its text through the choice's reasoning and tool-call parsers (which may hold text back,
    or send it as several pieces); the last one carries the finish_reason, "tool_calls" after a call. With
    return_token_ids the first carries the delta's token."""
    pieces = output.take(delta.text, delta.finish_reason is not None)
    if not pieces and (delta.finish_reason or delta.logprobs is not None or ids):
        pieces = [{"content": ""}]
    chunks = [fmt.chat_chunk(names, base, delta, top if i == 0 else None, piece, None)
              for i, piece in enumerate(pieces)]
    if ids and chunks:
        chunks[0]["choices"][0]["token_ids"] = [delta.token_id]
    if delta.finish_reason and chunks:
        chunks[-1]["choices"][0]["finish_reason"] = fmt.tool_finish(delta.finish_reason, output.calls)
    return chunks


def _finished(chunk: dict, delta: Delta, choices: list[Choice]) -> dict:
    """A choice's last chunk names what stopped it (vLLM's stop_reason)."""
    choice = chunk["choices"][0]
    if choice["finish_reason"] is not None:
        choice["stop_reason"] = choices[delta.index].stop_reason
    return chunk


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def typed_sse(event: dict[str, Any]) -> str:
    """An event of a typed stream (the Responses and Messages APIs): its type also on the event line."""
    return f"event: {event['type']}\n{sse(event)}"
