"""The one server launcher: `metronome serve` for a bench, on a free port, awaited until it
answers, stopped; what it ran (`command`) and on what (`served_facts`: model, dtype, engine
path, for the result's provenance).

    with Server.start(["--model", "preset:tiny"]) as server:   # a `metronome serve` child
        ... server.url, server.ws_url ...

`Server.start` runs it as a subprocess (the bench's own Python never shares its CPU time
slices); `Server.in_process` in this process (serve's `ServerThread`), for what only this
process can hand it: resume's two servers sharing one checkpoint store object.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

SERVE = [sys.executable, "-c", "from metronome.cli import app; app()", "serve"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """The plain server's readiness: /healthz answers 200."""
    try:
        return httpx.get(url + "/healthz", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def served_facts(model: str = "bundled", dtype: str = "auto") -> dict:
    """What `metronome serve --model MODEL --dtype DTYPE` runs on here, as `ctx.record`
    takes it (the default fast path falls back to dense attention where the paged kernel
    does not build)."""
    from metronome.model import native
    from metronome.model.dtypes import resolve_dtype

    path = "fast" if native.kernel() is not None else (
        f"fast without the paged kernel ({native.unavailable_reason()})")
    return {"model": model, "engine_path": path,
            "dtype": str(resolve_dtype(dtype)).removeprefix("torch.")}


class Server:
    def __init__(self, url: str, args: list[str], start_s: float, process=None, thread=None,
                 threads: int | None = None) -> None:
        self.url, self.args, self.start_s = url, args, start_s  # start_s: command to ready
        self.process, self.thread, self.threads = process, thread, threads

    @classmethod
    def start(cls, serve_args: list[str], ready: Callable[[str], bool] = healthy,
                log_path: Path | None = None, timeout_s: float = 180.0,
                threads: int | None = 1) -> Server:
        """`metronome serve <serve_args> --port <free>`, torch on `threads` (None: the
        machine's), its output to `log_path` (None: stderr only); returns once `ready(url)`."""
        args = [*serve_args, "--port", str(free_port())]
        url = f"http://127.0.0.1:{args[-1]}"
        env = os.environ | ({} if threads is None else {"OMP_NUM_THREADS": str(threads),
                                                         "MKL_NUM_THREADS": str(threads)})
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with (log_path.open("w") if log_path else open(os.devnull, "w")) as log:
            process = subprocess.Popen([*SERVE, *args], env=env, stdout=log,
                                       stderr=log if log_path else None)
        while not ready(url):
            if process.poll() is not None or time.monotonic() - started > timeout_s:
                process.kill()
                raise RuntimeError(f"`metronome serve {' '.join(args)}` did not come up within "
                                   f"{timeout_s:g} s (exit code {process.poll()})"
                                   + (f": see {log_path}" if log_path else ""))
            time.sleep(0.25)
        return cls(url, args, time.monotonic() - started, process=process, threads=threads)

    @classmethod
    def in_process(cls, config, model=None, tokenizer=None, **app_options) -> Server:
        """`ServerThread(config, model, tokenizer, **app_options)`, started."""
        from metronome.serve.server import ServerThread

        started = time.monotonic()
        thread = ServerThread(config, model, tokenizer, **app_options).__enter__()
        return cls(thread.url, ["(in process)"], time.monotonic() - started, thread=thread)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws") + "/v1/realtime"

    @property
    def command(self) -> str:
        """As a reader would type it, with the environment it ran with."""
        env = "" if self.threads is None else f"OMP_NUM_THREADS={self.threads} "
        return f"{env}metronome serve {' '.join(self.args)}"

    def stop(self) -> float:
        """SIGTERM (killed after 60 s), or the thread's exit; seconds it took."""
        started = time.monotonic()
        if self.thread is not None:
            self.thread.__exit__(None, None, None)
            return time.monotonic() - started
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return time.monotonic() - started

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
