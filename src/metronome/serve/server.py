"""Running the app under uvicorn: in the foreground (`metronome serve`) or on a background
thread of this process (tests, embedding), on sockets bound before the server starts: the
client port and the health listener's (`serve.edge.guard.Door`: probes get a connection
budget of their own). uvicorn runs our guarded protocols (`serve.edge.guard`: request
timeout, header and connection caps, a hard close for WebSockets)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import uvicorn

from metronome.model.llama import LlamaModel
from metronome.serve.app import create_app
from metronome.serve.config import ServerConfig
from metronome.serve.edge.guard import Door, protocols

STARTUP_TIMEOUT_S = 120.0  # a first start converts the bundled model (~20 s on 2 cores)


SPURIOUS_DENIAL_ERROR = "ASGI callable returned without completing handshake."


class _DenialLogFilter(logging.Filter):
    """uvicorn's sans-I/O WebSocket protocol logs SPURIOUS_DENIAL_ERROR after every denial
    response it sent correctly (our HTTP 503 before the upgrade); this app never returns
    without a handshake otherwise, so the line would only mislead operators."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != SPURIOUS_DENIAL_ERROR


DENIAL_LOG_FILTER = _DenialLogFilter()  # one instance: adding it again is a no-op


def uvicorn_config(app, config: ServerConfig, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for `app`, with one `Door` for the server (`app.state.door`: the
    health listener's port is added to it once its socket is bound)."""
    door = Door(config.transport_limits())
    app.state.door = door
    settings = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=log_level,
        ws_max_size=config.ws_max_message_bytes,  # the hard cap; see ServerConfig
        ws_per_message_deflate=False,  # PCM does not compress; deflate costs CPU per message
        **protocols(door),
    )
    logging.getLogger("uvicorn.error").addFilter(DENIAL_LOG_FILTER)  # after uvicorn's setup
    return settings


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port` (IPv6 if the host is one), as uvicorn binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.set_inheritable(True)
    return sock


def bind_listeners(config: ServerConfig, door: Door, host: str | None = None,
                   port: int | None = None, health_port: int | None = None
                   ) -> tuple[socket.socket, socket.socket]:
    """The client socket and the health listener's (the config's addresses unless given),
    the health port told to `door`."""
    main = bind(host or config.host, config.port if port is None else port)
    health_host, configured_port = config.health_address()
    try:
        health = bind(host or health_host,
                      configured_port if health_port is None else health_port)
    except OSError:
        main.close()
        raise
    door.health_ports.add(health.getsockname()[1])
    return main, health


def serve_forever(config: ServerConfig, log_level: str = "info") -> None:
    from metronome.model.dtypes import resolve_dtype

    app = create_app(config)
    settings = uvicorn_config(app, config, log_level)
    main, health = bind_listeners(config, app.state.door)
    base = f"{config.host}:{main.getsockname()[1]}"
    health_base = "{}:{}".format(*health.getsockname()[:2])
    dtype = str(resolve_dtype(config.dtype)).removeprefix("torch.")
    print(
        f"metronome: serving {config.model} ({dtype}, KV {config.policy}) on "
        f"ws://{base}/v1/realtime  (probes: http://{health_base}/healthz, /readyz, "
        "/metrics)\n"
        f"           talk to it: http://{base}/console   (status: http://{base}/status; "
        "Ctrl-C stops the server)\n"
        f"           load it: metronome load --url ws://{base}/v1/realtime --sessions 2 "
        "--duration-s 10",
        flush=True,
    )
    uvicorn.Server(settings).run(sockets=[main, health])


class ServerThread:
    """`with ServerThread(config, model, tokenizer) as server:` serves on `server.url`
    (127.0.0.1, a free port) until the block ends."""

    def __init__(self, config: ServerConfig, model: LlamaModel | None = None, tokenizer=None,
                 log_level: str = "warning", **app_options) -> None:
        self.app = create_app(config, model, tokenizer, **app_options)
        self.server = uvicorn.Server(uvicorn_config(self.app, config, log_level))
        self._socket, self._health_socket = bind_listeners(
            config, self.app.state.door, "127.0.0.1", 0, config.health_port or 0)
        self.port = self._socket.getsockname()[1]
        self.health_port = self._health_socket.getsockname()[1]
        self._thread = threading.Thread(target=self.server.run, kwargs={
            "sockets": [self._socket, self._health_socket]}, name="metronome-server",
            daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on 127.0.0.1:{self.port} did not start: its "
                                   "thread ended (the startup error is logged above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server on 127.0.0.1:{self.port} did not start "
                                   f"within {STARTUP_TIMEOUT_S:g} s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
        self._health_socket.close()
