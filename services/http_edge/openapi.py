"""/openapi.json and /docs (Swagger UI): FastAPI's generator, fed the models it cannot see.

`POST /v1/chat/completions` reads its raw body itself (the size limit, the
duplicate-key and Unicode checks of serving.py), so FastAPI knows neither
its request nor its replies. Each route names its schemas here by reference
(`openapi_extra`), and the document's components are the pydantic models:
protocol.ChatCompletionRequest in, schemas.py out.
"""
from __future__ import annotations

from importlib import metadata, resources
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse
from pydantic.json_schema import models_json_schema

from services.common.chat_protocol import ChatCompletionRequest
from services.common.fingerprint import stormserve_version
from services.http_edge.schemas import RESPONSE_MODELS

OPENAPI_URL = "/openapi.json"
REF = "#/components/schemas/{model}"
# FastAPI documents its own 422 body for routes with parameters; ours is ErrorBody.
_FRAMEWORK_SCHEMAS = ("HTTPValidationError", "ValidationError")


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def json_content(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": ref(name)}}


# Any request may be refused by the HTTP protocol before it reaches a route
# (http_protocol.py): malformed HTTP, a head that came too slowly, a head too large.
PROTOCOL_ERRORS = (400, 408, 431)


def errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "the error body", "content": json_content("ErrorBody")}
            for s in sorted({*statuses, *PROTOCOL_ERRORS})}


CHAT_COMPLETIONS = {
    "requestBody": {"required": True, "content": json_content("ChatCompletionRequest")},
    "responses": {
        "200": {
            "description": "`chat.completion`, or with `stream` true an SSE stream of "
                           "`data: <chat.completion.chunk>` events (a failure after the first one "
                           "ends it with a StreamErrorFrame) and `data: [DONE]`",
            "content": {
                **json_content("ChatCompletion"),
                "text/event-stream": {"schema": {"oneOf": [ref("ChatCompletionChunk"), ref("StreamErrorFrame")]}},
            },
        },
        # 408 also for a body that came too slowly, 415 for a body not declared JSON,
        # 429 for an API key over one of its limits (with Retry-After)
        **errors(401, 413, 415, 422, 424, 429, 500, 503),
    },
}
LIST_MODELS = {"responses": {"200": {"description": "the served models", "content": json_content("ModelList")},
                             **errors(401, 503)}}
GET_MODEL = {"responses": {"200": {"description": "the model", "content": json_content("ModelCard")},
                           **errors(401, 404, 422, 503)}}
HEALTH = {"responses": {"200": {"description": "ChatService is serving (empty body)", "content": {}},
                        **errors(503)}, "security": []}


def component_schemas() -> dict[str, Any]:
    _, schema = models_json_schema(
        [(ChatCompletionRequest, "validation"), *((m, "serialization") for m in RESPONSE_MODELS)],
        ref_template=REF,
    )
    return schema["$defs"]


def openapi_document(app: FastAPI, keyed: bool) -> dict[str, Any]:
    """Built on first use and kept (app.openapi_schema), as FastAPI does."""
    if app.openapi_schema is None:
        doc = get_openapi(
            title=app.title, version=stormserve_version(), description=app.description, routes=app.routes
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in _FRAMEWORK_SCHEMAS:
            schemas.pop(name, None)
        schemas.update(component_schemas())
        if keyed:
            doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
            doc["security"] = [{"apiKey": []}]
        app.openapi_schema = doc
    return app.openapi_schema


# /docs works on an air-gapped cluster: the edge serves Swagger UI's files itself
# instead of FastAPI's default CDN. They come from the pinned fastapi-offline wheel
# (Swagger UI 5.x, the line FastAPI's page is written for; only its files are used,
# not its app factory, whose static mount would skip the key check). Not
# swagger-ui-bundle 1.1.0: it carries Swagger UI 4.15.5, which cannot render an
# OpenAPI 3.1 document such as ours.
# The package's version is in the path, so a browser may keep the files for a year.
ASSETS_URL = f"/docs/assets/{metadata.version('fastapi-offline')}"
ASSETS_CACHE_CONTROL = "public, max-age=31536000, immutable"
ASSET_TYPES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon.png": "image/png",
}


def asset(name: str) -> FileResponse | None:
    """One of Swagger UI's files, or None for any other name."""
    if name not in ASSET_TYPES:
        return None
    path = resources.files("fastapi_offline") / "static" / name
    return FileResponse(str(path), media_type=ASSET_TYPES[name], headers={"Cache-Control": ASSETS_CACHE_CONTROL})


def swagger_page(app: FastAPI) -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url=OPENAPI_URL,
        title=f"{app.title} - API",
        swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
        swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
    )
