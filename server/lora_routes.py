"""vLLM's run-time LoRA routes (with --enable-lora): POST /v1/load_lora_adapter reads a PEFT folder off the event
loop and registers the adapter in the engine thread between steps; POST /v1/unload_lora_adapter drops one that no
request runs or waits with, and refuses (400) while one does: the caller retries once they are done, where vLLM
would let them finish on an adapter it no longer lists."""

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from pegainfer.errors import PegainferError, RequestError
from pegainfer.frontends.lora import LoraConfig, read_adapter
from pegainfer.ir.graph import Graph
from pegainfer.server import responses as schema
from pegainfer.server.errors import ApiError
from pegainfer.server.protocol import LoadLoraRequest, UnloadLoraRequest

if TYPE_CHECKING:
    from pegainfer.server.app import ServerContext

TEXT = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


@dataclass(frozen=True)
class LoraService:
    """What reading an adapter for this server takes: the engine's graph (its LoRA tables) and their sizes."""
    graph: Graph
    config: LoraConfig


def add_lora_routes(app: FastAPI, ctx: "ServerContext") -> None:
    @app.post("/v1/load_lora_adapter", responses={**TEXT, **schema.error_responses(400, 401, 413, 415)})
    async def load_lora_adapter(body: LoadLoraRequest) -> Response:
        service = enabled(ctx)
        name = body.lora_name
        if name in ctx.lora_paths or name == ctx.model_name:
            raise ApiError(400, f"the model name {name!r} is already in use on this server", "lora_name")
        try:
            adapter = await asyncio.to_thread(read_adapter, name, Path(body.lora_path), service.graph, service.config)
        except PegainferError as error:
            raise ApiError(400, str(error), "lora_path") from None
        await asyncio.wrap_future(ctx.engine.call(lambda: ctx.engine.scheduler.lora.register(adapter)))
        ctx.lora_paths[name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses={**TEXT, **schema.error_responses(400, 401, 404, 413, 415)})
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Response:
        enabled(ctx)
        name = body.lora_name
        if name not in ctx.lora_paths:
            raise ApiError(404, f"no LoRA adapter named {name!r} is loaded", "lora_name", "model_not_found")
        scheduler = ctx.engine.scheduler

        def unload() -> None:
            if scheduler.lora_in_use(name):
                raise RequestError(f"LoRA adapter {name!r} is in use by running or waiting requests: unload it "
                                   f"once they are done")
            scheduler.lora.unregister(name)
        try:
            await asyncio.wrap_future(ctx.engine.call(unload))
        except RequestError as error:
            raise ApiError(400, str(error), "lora_name") from None
        del ctx.lora_paths[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def enabled(ctx: "ServerContext") -> LoraService:
    if ctx.lora is None:
        raise ApiError(400, "LoRA adapters are not enabled on this server: start it with --enable-lora", "lora_name")
    return ctx.lora
