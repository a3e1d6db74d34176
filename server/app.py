"""The OpenAI-compatible HTTP API over the engine loop: /v1/completions, /v1/chat/completions, /v1/models,
/tokenize, /detokenize, /tokenizer_info, /health, /metrics, /version and /openapi.json."""

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from pegainfer import __version__
from pegainfer.errors import RequestError
from pegainfer.runtime.chat import ChatTemplate
from pegainfer.runtime.engine_loop import EngineDead, EngineLoop
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.tokenizer import TextTokenizer
from pegainfer.server import openai_format as fmt
from pegainfer.server import responses as schema
from pegainfer.server.chat_output import ChatOutputStream
from pegainfer.server.errors import (ApiError, api_error_handler, error_body, http_error_handler,
                                     internal_error_handler, validation_error_handler)
from pegainfer.server.generation import Choice, Delta, run_choice
from pegainfer.server.guard import Guard
from pegainfer.server.metrics import Metrics
from pegainfer.server.openapi import openapi_document
from pegainfer.server.lora_routes import LoraService, add_lora_routes
from pegainfer.server.prepare import Prepared, check_ids, check_model, prepare_chat, prepare_completion, render_chat
from pegainfer.server.prompts import PromptEncoder
from pegainfer.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, \
    TokenizeRequest, _Sampling
from pegainfer.server.structured import Grammars

MAX_SEQS_PER_REQUEST = 256  # prompts x n of one request, by default (--max-seqs-per-request)


@dataclass
class ServerContext:
    engine: EngineLoop
    tokenizer: TextTokenizer
    chat_template: ChatTemplate | None
    model_name: str
    model_root: str
    max_model_len: int
    vocab_size: int
    metrics: Metrics
    api_key: str | None = None
    max_request_bytes: int = 8 << 20
    max_seqs_per_request: int = MAX_SEQS_PER_REQUEST
    tool_call_parser: str | None = None  # --tool-call-parser: how tool calls are read from (and forced into) text
    auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # generation_config.json's (--generation-config)
    lora: "LoraService | None" = None  # --enable-lora: the adapters, loaded and unloaded at run time
    lora_paths: dict[str, str] = field(default_factory=dict)  # adapter name -> its folder, as loaded
    encoder: PromptEncoder = field(init=False)
    grammars: Grammars = field(init=False)

    def __post_init__(self) -> None:
        self.encoder = PromptEncoder(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.vocab_size)


def build_app(ctx: ServerContext) -> Guard:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        ctx.encoder.close()

    app = FastAPI(title="pegainfer", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan)
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.state.ctx = ctx
    add_info_routes(app, ctx)
    add_generation_routes(app, ctx)
    add_lora_routes(app, ctx)
    app.openapi = lambda: openapi_document(app, secured=ctx.api_key is not None)
    return Guard(app, ctx)


def add_info_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health", response_model=schema.Health, responses=schema.error_responses(503))
    async def health() -> Response:
        if not ctx.engine.healthy:
            reason = f"{type(ctx.engine.error).__name__}: {ctx.engine.error}" if ctx.engine.error else "stopped"
            return JSONResponse(error_body(503, f"the engine has failed: {reason}"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        text = ctx.metrics.render(ctx.engine.scheduler, ctx.engine.healthy)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/version", response_model=schema.Version)
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models", response_model=schema.ModelList, responses=schema.error_responses(401))
    async def models() -> dict:
        return {"object": "list", "data": [model_card(ctx), *(model_card(ctx, name) for name in ctx.lora_paths)]}

    @app.get("/v1/models/{model_id:path}", response_model=schema.ModelCard,
             responses=schema.error_responses(401, 404))
    async def model(model_id: str) -> dict:
        return model_card(ctx, check_model(ctx, model_id))

    @app.post("/tokenize", response_model=schema.Tokenized, responses=schema.error_responses(400, 401, 404, 413, 415))
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(ctx, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        add_special = body.messages is None if body.add_special_tokens is None else body.add_special_tokens
        text, param = (body.prompt, "prompt") if body.prompt is not None else \
            (render_chat(ctx, body.messages, body.add_generation_prompt, body.chat_template_kwargs), "messages")
        ids = await ctx.encoder.encode(text, ctx.max_model_len, param, ctx.max_model_len)
        ids = ids if add_special else ctx.tokenizer.without_added_specials(ids)
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=schema.Detokenized,
              responses=schema.error_responses(400, 401, 404, 413, 415))
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(ctx, body.model)
        check_ids(ctx, body.tokens, "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info", response_model=dict[str, Any], responses=schema.error_responses(401))
    async def tokenizer_info() -> dict:
        """vLLM's /tokenizer_info, which lm-eval's remote tokenizer and vLLM clients read."""
        return ctx.tokenizer.info(ctx.chat_template and ctx.chat_template.source, ctx.max_model_len)


def add_generation_routes(app: FastAPI, ctx: ServerContext) -> None:
    errors = schema.error_responses(400, 401, 404, 413, 415, 503)

    @app.post("/v1/completions", response_model=None,
              responses={200: {"model": schema.Completion, "content": schema.STREAM}, **errors})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prepared = await prepare_completion(ctx, body)
        echo = prepared.prompt_texts if body.echo else [""] * len(prepared.prompts)
        return await respond(ctx, request, body, prepared, chat=False, echo=echo, top=body.logprobs)

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": schema.ChatCompletion, "content": schema.STREAM}, **errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prepared = await prepare_chat(ctx, body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await respond(ctx, request, body, prepared, chat=True, echo=[""], top=top)


def model_card(ctx: ServerContext, lora: str | None = None) -> dict:
    """The base model's card, or a LoRA adapter's (its folder the root, the base its parent, as vLLM lists them)."""
    card = {"id": lora or ctx.model_name, "object": "model", "created": 0, "owned_by": "pegainfer",
            "root": ctx.lora_paths[lora] if lora else ctx.model_root, "max_model_len": ctx.max_model_len}
    return card | ({"parent": ctx.model_name} if lora else {})


# --- running it ----------------------------------------------------------------------------------------------------

async def merged(ctx: ServerContext, prepared: Prepared, prefix: str, choices: list[Choice]) -> AsyncIterator[Delta]:
    """Every choice of every prompt at once; deltas in the order tokens arrive."""
    queue: asyncio.Queue = asyncio.Queue()
    n = len(prepared.params) // len(prepared.prompts)

    async def pump(index: int) -> None:
        prompt = prepared.prompts[index // n]
        constraint = prepared.constraint(prompt) if prepared.constraint is not None else None
        request = EngineRequest(f"{prefix}-{index}", prompt, prepared.params[index],
                                prepared.stop_token_ids, group=prefix, constraint=constraint, lora=prepared.lora)
        try:
            async for delta in run_choice(ctx.engine, request, ctx.tokenizer, prepared.stops, index, ctx.metrics,
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


async def respond(ctx: ServerContext, request: Request, body: _Sampling, prepared: Prepared, *, chat: bool,
                  echo: list[str], top: int | None) -> Response:
    if not ctx.engine.healthy:
        raise ApiError(503, f"the engine has failed: {ctx.engine.error}")
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choices = [Choice(i) for i in range(len(prepared.params))]
    prompt_tokens = sum(len(ids) for ids in prepared.prompts)
    n = body.n
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = stream_events(ctx, prepared, request_id, choices, chat, echo, top, n, include_usage, prompt_tokens)
        return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose))
    task = asyncio.ensure_future(_drain(merged(ctx, prepared, request_id, choices)))
    watcher = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():  # the client is gone: abort its requests (their KV blocks are freed) and answer nobody
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    _raise_engine_errors(task.exception())
    if prepared.score_only:  # max_tokens 0: the prompt's logprobs alone
        for choice in choices:
            choice.text, choice.token_ids, choice.logprobs, choice.finish_reason = "", [], [], "length"
    base = fmt.envelope(request_id, "chat.completion" if chat else "text_completion", prepared.lora or ctx.model_name)
    if chat:
        body_choices = [fmt.chat_choice(ctx.tokenizer, c, top, prepared.output) for c in choices]
        base |= fmt.prompt_logprobs_field(ctx.tokenizer, choices[0], prepared.prompts[0], body.prompt_logprobs)
    else:
        body_choices = [fmt.completion_choice(ctx.tokenizer, c, echo[c.index // n], top is not None,
                                              prepared.prompts[c.index // n], body.prompt_logprobs)
                        for c in choices]
    return JSONResponse({**base, "choices": body_choices, "usage": fmt.usage(prompt_tokens, choices, n)})


async def _drain(deltas: AsyncIterator[Delta]) -> None:
    async for _ in deltas:
        pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _raise_engine_errors(error: BaseException | None) -> None:
    if error is None:
        return
    if isinstance(error, EngineDead):
        raise ApiError(503, str(error))
    if isinstance(error, RequestError):
        raise ApiError(400, str(error))
    raise error


async def stream_events(ctx: ServerContext, prepared: Prepared, request_id: str, choices: list[Choice], chat: bool,
                        echo: list[str], top: int | None, n: int, include_usage: bool,
                        prompt_tokens: int) -> AsyncIterator[str]:
    base = fmt.envelope(request_id, "chat.completion.chunk" if chat else "text_completion",
                        prepared.lora or ctx.model_name)
    if include_usage:
        base["usage"] = None
    if chat:
        for index in range(len(choices)):
            yield _sse(fmt.chat_role_chunk(base, index))
    echoed: set[int] = set()
    outputs = [prepared.output.stream() for _ in choices] if chat else []
    try:
        async for delta in merged(ctx, prepared, request_id, choices):
            if not (delta.text or delta.finish_reason or delta.logprobs is not None):
                continue  # held-back text with nothing else to say
            if chat:
                for chunk in chat_chunks(ctx, base, delta, top, outputs[delta.index]):
                    yield _sse(chunk)
                continue
            else:
                prefix = "" if delta.index in echoed else echo[delta.index // n]
                echoed.add(delta.index)
                offset = len(echo[delta.index // n]) + delta.offset
                steps = choices[delta.index].prompt_logprobs
                prompt = None if steps is None else (prepared.prompts[delta.index // n], steps)
                chunk = fmt.completion_chunk(ctx.tokenizer, base, delta, prefix, offset, prompt)
            yield _sse(chunk)
    except (EngineDead, RequestError) as error:
        status = 503 if isinstance(error, EngineDead) else 400
        yield _sse(error_body(status, str(error)))
    else:
        if include_usage:
            yield _sse({**base, "choices": [], "usage": fmt.usage(prompt_tokens, choices, n)})
    yield "data: [DONE]\n\n"


def chat_chunks(ctx: ServerContext, base: dict, delta: Delta, top: int | None,
                output: ChatOutputStream) -> list[dict]:
    """A delta's chunks: its text through the choice's reasoning and tool-call parsers (which may hold text back,
    or send it as several pieces); the last one carries the finish_reason, "tool_calls" after a call."""
    pieces = output.feed(delta.text) + (output.finish() if delta.finish_reason else [])
    if not pieces and (delta.finish_reason or delta.logprobs is not None):
        pieces = [{"content": ""}]
    chunks = [fmt.chat_chunk(ctx.tokenizer, base, delta, top if i == 0 else None, piece, None)
              for i, piece in enumerate(pieces)]
    if delta.finish_reason and chunks:
        chunks[-1]["choices"][0]["finish_reason"] = fmt.tool_finish(delta.finish_reason, output.calls)
    return chunks


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
