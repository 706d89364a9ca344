"""The FastAPI app: `GET /healthz`, `GET /metrics`, `GET /v1/sessions`, `WS /v1/realtime`.

The lifespan builds the serving state inside the running loop (the wall driver needs it):
model (loaded from the config unless injected), engine, `ServerState`. With an API key
configured, every route but `/healthz` needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from metronome.engine.engine import Engine
from metronome.model.llama import LlamaModel
from metronome.serve import protocol as p
from metronome.serve.auth import bearer_matches
from metronome.serve.config import ServerConfig
from metronome.serve.connection import Connection
from metronome.serve.state import ServerState
from metronome.serve.status import add_status_routes


class Unauthorized(Exception):
    pass


def create_app(config: ServerConfig, model: LlamaModel | None = None, tokenizer=None,
               registry: CollectorRegistry | None = None) -> FastAPI:
    """`model=None` loads `config.model` at startup (with its tokenizer); an injected model
    comes with its tokenizer (None: audio only). Metrics go to `registry` (default: a new
    one per app, never the process-global registry)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served, tok = (model, tokenizer) if model is not None else _load(config)
        engine = Engine(served, config.engine_config())
        engine.warm_up()  # before the engine thread starts: the first user pays no warm-up
        # Everything alive now (model, tokenizer, imports) lives for the whole process: keep
        # it out of the cyclic GC's scans, whose full passes would otherwise pause the loop
        # and the engine thread for long enough to make frames late.
        gc.collect()
        gc.freeze()
        state = ServerState(config, engine, tok, registry or CollectorRegistry(),
                            model_name=served.config.name)
        app.state.serving = state
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="metronome", lifespan=lifespan)
    app.add_exception_handler(Unauthorized, _unauthorized)
    _routes(app, config)
    return app


def _load(config: ServerConfig):

    from metronome.model.weights import load_model, load_tokenizer, resolve_dtype

    dtype = resolve_dtype(config.dtype)
    return load_model(config.model, dtype), load_tokenizer(config.model)


def _routes(app: FastAPI, config: ServerConfig) -> None:
    async def authorized(request: Request) -> None:
        if not bearer_matches(request.headers.get("authorization"), config.api_key):
            raise Unauthorized

    guarded = [Depends(authorized)]

    # async handlers: they read loop-owned state, so they must run on the loop thread
    @app.get("/healthz")
    async def healthz(request: Request) -> dict:
        return request.app.state.serving.health()

    @app.get("/metrics", dependencies=guarded)
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.serving.metrics.render(),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/sessions", dependencies=guarded)
    async def sessions(request: Request) -> dict:
        return request.app.state.serving.session_list()

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        await Connection(websocket, websocket.app.state.serving).serve()

    add_status_routes(app, lambda request: request.app.state.serving.status_board, guarded)


async def _unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
    error = p.ErrorDetail(type=p.ErrorType.INVALID_REQUEST, code=p.ErrorCode.INVALID_API_KEY,
                          message="missing or invalid bearer API key")
    return JSONResponse({"error": error.model_dump(mode="json")}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})
