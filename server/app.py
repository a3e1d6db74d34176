"""The OpenAI-compatible HTTP API over the engine loop: /v1/completions, /v1/chat/completions, /v1/responses,
Anthropic's /v1/messages, /v1/models, /tokenize, /detokenize, /tokenizer_info, /health, /metrics, /version and
/openapi.json."""

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from pegainfer import __version__
from pegainfer.runtime.chat import ChatTemplate
from pegainfer.runtime.engine_loop import EngineLoop
from pegainfer.runtime.tokenizer import TextTokenizer
from pegainfer.server import responses as schema
from pegainfer.server.errors import (ApiError, api_error_handler, error_body, http_error_handler,
                                     internal_error_handler, validation_error_handler)
from pegainfer.server.guard import Guard
from pegainfer.server.messages_route import add_messages_routes
from pegainfer.server.metrics import Metrics
from pegainfer.server.openapi import openapi_document
from pegainfer.server.lora_routes import LoraService, add_lora_routes
from pegainfer.server.respond import respond
from pegainfer.server.responses_route import add_responses_routes
from pegainfer.server.prepare import (check_ids, check_model, prepare_chat, prepare_completion, render_chat,
                                      template_kwargs)
from pegainfer.server.prompts import PromptEncoder
from pegainfer.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pegainfer.server.structured import Grammars
from pegainfer.server.tools import check_tools

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
    add_responses_routes(app, ctx)
    add_messages_routes(app, ctx)
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
        text, param = body.prompt, "prompt"
        if body.messages is not None:
            kwargs = template_kwargs(body, body.tools if check_tools(body.tools) else None)
            text = render_chat(ctx, body.messages, body.add_generation_prompt, kwargs, body.continue_final_message)
            param = "messages"
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
