"""The OpenAPI document the server publishes at /openapi.json: FastAPI's, made true to what the server answers.
Bad input is a 400 with an OpenAI error object (FastAPI would list its own 422), and the bearer key is declared
when the server has one."""

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pegainfer.server.guard import PUBLIC_PATHS

_FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")


def openapi_document(app: FastAPI, *, secured: bool) -> dict[str, Any]:
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                               description="An OpenAI-compatible API: completions, chat completions, models, "
                                           "tokenize and detokenize.")
        for operations in document["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        schemas = document.get("components", {}).get("schemas", {})
        for name in _FASTAPI_VALIDATION:
            schemas.pop(name, None)
        if secured:
            document.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http",
                                                                                   "scheme": "bearer"}}
            for path, operations in document["paths"].items():
                for operation in operations.values():
                    if path not in PUBLIC_PATHS:
                        operation["security"] = [{"bearer": []}]
        app.openapi_schema = document
    return app.openapi_schema
