"""HTTP wiring of the edge: routes, the error handlers and the backend's lifetime.

    POST /v1/chat/completions   JSON or SSE (serving.py)
    GET  /v1/models             ListModels, cached briefly
    GET  /v1/models/{model}     one model, or 404
    GET  /health                200 (empty body) when ChatService is SERVING, else 503
    GET  /openapi.json          the OpenAPI document (openapi.py)
    GET  /docs                  Swagger UI on /openapi.json
    GET  /docs/assets/<v>/...   Swagger UI's script, CSS and icon (openapi.py)
    GET  /metrics               Prometheus text: the edge's own series (metrics.py)

With API keys configured every route but /health and /metrics needs
`Authorization: Bearer` (auth.py); load balancers probe /health without
credentials. Once the edge drains (SIGTERM) every new request, /health
included, gets 503 (drain.py).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from stormserve.chat.v1 import chat_pb2

from services.http_edge import openapi
from services.http_edge.auth import ApiKeyCheck, credential_metadata
from services.common.api_keys import KeyStore
from services.common.drain import Drain
from services.common.tls import InternalTls
from services.http_edge.backend import ChatBackend
from services.http_edge.config import EdgeConfig
from services.http_edge.drain import RefuseWhileDraining
from services.http_edge.errors import EdgeError, install_error_handlers, unavailable
from services.http_edge.metrics import EdgeMetrics
from services.http_edge.observe import ObserveMiddleware
from services.http_edge.serving import ChatCompletions


def model_json(model: chat_pb2.Model) -> dict[str, Any]:
    return {
        "id": model.id,
        "object": "model",
        "created": model.created,
        "owned_by": model.owned_by,
        "root": model.root,
        "parent": None,
        "max_model_len": model.max_model_len,
    }


def create_app(config: EdgeConfig, backend: ChatBackend | None = None) -> FastAPI:
    backend = backend or ChatBackend(config.tokenizer_address, config.models_cache_s, tls=InternalTls.of(config))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()

    app = FastAPI(
        title="stormserve http_edge",
        description="OpenAI/DeepSeek/MindIE-compatible chat completions.",
        lifespan=lifespan,
        # FastAPI's own /docs and /openapi.json take no dependencies; ours below check the key.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # The request's server span is ObserveMiddleware's (observe.py), which wraps the
        # whole reply, refusals included; FastAPI's own would be a second one.
        telemetry={"tracing": False},
    )
    app.state.config = config
    app.state.backend = backend
    app.state.drain = Drain("http_edge")
    app.add_middleware(RefuseWhileDraining, drain=app.state.drain)
    install_error_handlers(app)
    metrics = app.state.metrics = EdgeMetrics()
    app.add_middleware(ObserveMiddleware, metrics=metrics)
    chat_completions = ChatCompletions(config, backend)
    api_keys = KeyStore.from_config(config)
    # Runs before the body is read: an unauthenticated client cannot make us buffer 40 MiB.
    keyed = [Depends(ApiKeyCheck(api_keys))]

    @app.post("/v1/chat/completions", dependencies=keyed, openapi_extra=openapi.CHAT_COMPLETIONS)
    async def create_chat_completion(request: Request) -> Response:
        return await chat_completions(request)

    @app.get("/v1/models", dependencies=keyed, openapi_extra=openapi.LIST_MODELS)
    async def list_models(request: Request) -> JSONResponse:
        models = await backend.served_models(credential_metadata(request))
        return JSONResponse({"object": "list", "data": [model_json(m) for m in models]})

    @app.get("/v1/models/{model_id}", dependencies=keyed, openapi_extra=openapi.GET_MODEL)
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        for model in await backend.served_models(credential_metadata(request)):
            if model.id == model_id:
                return JSONResponse(model_json(model))
        raise EdgeError(404, "NotFoundError", f"Model {model_id} not found.")

    @app.get("/metrics", include_in_schema=False)  # Prometheus text, not part of the API
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", openapi_extra=openapi.HEALTH)
    async def health() -> Response:
        if await backend.is_serving():
            return Response(status_code=200)
        raise unavailable("ChatService is not serving")

    @app.get(openapi.OPENAPI_URL, dependencies=keyed, include_in_schema=False)
    async def openapi_json() -> JSONResponse:
        return JSONResponse(openapi.openapi_document(app, keyed=api_keys.is_enabled))

    @app.get("/docs", dependencies=keyed, include_in_schema=False)
    async def docs() -> Response:
        return openapi.swagger_page(app)

    @app.get(openapi.ASSETS_URL + "/{name}", dependencies=keyed, include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        if (found := openapi.asset(name)) is None:
            raise EdgeError(404, "NotFoundError", f"No asset {name}.")
        return found

    return app
