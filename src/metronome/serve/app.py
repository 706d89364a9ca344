"""The FastAPI app: `GET /healthz`, `GET /readyz`, `GET /metrics`, `GET /v1/sessions`,
`WS /v1/realtime`. `/healthz` (liveness: the server's health verdict, 200 while it answers)
and `/readyz` (readiness: 200 while it takes new sessions, 503 draining) are served on the
client port and on the health listener (`serve.edge.guard`), which probes should use.

The lifespan builds the serving state inside the running loop (the wall driver needs it):
model (loaded from the config unless injected), engine, `Serving`. With an API key
configured, every HTTP path but `/healthz` needs it (`serve.edge.auth.KeyGuard`: the docs and the
OpenAPI schema too), and `/healthz` without it tells only `{"status": ...}`; the WebSocket is
refused before the upgrade by its connection.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from metronome.engine.engine import Engine
from metronome.model.llama import LlamaModel
from metronome.serve.config import ServerConfig
from metronome.serve.connection import Connection
from metronome.serve.console import CONSOLE_PAGE_PATH, add_console_routes
from metronome.serve.edge.auth import KeyGuard, request_has_key
from metronome.serve.resume.checkpoint import CheckpointStore
from metronome.serve.serving import Serving
from metronome.serve.status import STATUS_PAGE_PATH, add_status_routes

OPEN_PATHS = frozenset({"/healthz", "/readyz", STATUS_PAGE_PATH, CONSOLE_PAGE_PATH})
# /healthz: its status only without the key; /readyz says ready or draining; the status page
# and the console hold no data (they poll /v1/status, which needs the key; the console's
# WebSocket offers it too)


def create_app(config: ServerConfig, model: LlamaModel | None = None, tokenizer=None,
               registry: CollectorRegistry | None = None,
               checkpoint_store: CheckpointStore | None = None,
               server_name: str = "local") -> FastAPI:
    """`model=None` loads `config.model` at startup (with its tokenizer); an injected model
    comes with its tokenizer (None: audio only). Metrics go to `registry` (default: a new
    one per app, never the process-global registry). With `checkpoint_store` (a cluster's)
    bounded sessions are checkpointed there as `server_name`, and sessions other servers
    checkpointed resume here (`serve.resume.takeover`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine, tok, model_name = _engine(config, model, tokenizer)
        try:
            engine.warm_up()  # before the engine thread starts: the first user pays none
            # Everything alive now (model, tokenizer, imports) lives for the whole process:
            # keep it out of the cyclic GC's scans, whose full passes would otherwise pause
            # the loop and the engine thread for long enough to make frames late.
            gc.collect()
            gc.freeze()
            state = Serving(config, engine, tok, registry or CollectorRegistry(),
                                model_name=model_name, checkpoint_store=checkpoint_store,
                                server_name=server_name)
            app.state.serving = state
            door = getattr(app.state, "door", None)  # under `serve.server`'s uvicorn
            if door is not None:
                state.metrics.watch_door(door)
            try:
                yield
            finally:
                state.close()
        finally:
            engine.shutdown()

    app = FastAPI(title="metronome", lifespan=lifespan)
    app.add_middleware(KeyGuard, api_key=config.api_key, open_paths=OPEN_PATHS)
    _routes(app, config)
    add_status_routes(app, lambda request: request.app.state.serving.status_board)
    add_console_routes(app)
    return app


def _engine(config: ServerConfig, model: LlamaModel | None, tokenizer):
    """The engine the config asks for, its tokenizer and the model's name."""
    if config.engine == "vllm":
        from metronome.kv.residency import ResidencyPolicy
        from metronome.model.weights import load_tokenizer
        from metronome.vllm.engine import VllmEngine

        if model is not None:
            raise ValueError("--engine vllm loads its model itself: inject none")
        engine = VllmEngine.for_model(config.model, ResidencyPolicy.parse(config.policy),
                                      config.pool_tokens, config.block_size, config.dtype,
                                      mode=config.vllm_mode)
        return engine, load_tokenizer(config.model), engine.model_name
    served, tok = (model, tokenizer) if model is not None else _load(config)
    return Engine(served, config.engine_config()), tok, served.config.name


def _load(config: ServerConfig):

    from metronome.model.dtypes import resolve_dtype
    from metronome.model.weights import load_model, load_tokenizer

    dtype = resolve_dtype(config.dtype)
    return load_model(config.model, dtype), load_tokenizer(config.model)


def _routes(app: FastAPI, config: ServerConfig) -> None:
    # async handlers: they read loop-owned state, so they must run on the loop thread
    @app.get("/healthz")
    async def healthz(request: Request) -> dict:
        health = request.app.state.serving.health()
        return health if request_has_key(request.scope, config.api_key) else {
            "status": health["status"]}

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        serving = request.app.state.serving
        ready = not serving.draining
        return JSONResponse({"status": "ready" if ready else "draining"},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.serving.metrics.render(),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/sessions")
    async def sessions(request: Request) -> dict:
        return request.app.state.serving.session_list()

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        await Connection(websocket, websocket.app.state.serving).serve()

