"""The one server launcher: `with Server.start(["--model", "preset:tiny"]) as server:` runs
`metronome serve` on a free port in a subprocess (the bench's Python never shares its CPU
slices), awaited until it answers, stopped after; `Server.in_process` runs serve's
`ServerThread` here, for what only this process can hand it (resume's shared store).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SERVE = [sys.executable, "-c", "from metronome.cli import app; app()", "serve"]
# The benches measure the engine, the beat and the wire with the embedding front end (one KV
# entry per audio token, as an omni encoder) and text replies, in duplex unless a preset
# says otherwise (its own flags come after these, and win): not hearing and speaking, whose
# cost `metronome bench voice` measures.
TEXT_SERVER_ARGS = ["--mode", "duplex", "--audio-input", "embeddings", "--no-output-audio",
                    "--no-server-vad"]


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
    """What `metronome serve --model MODEL --dtype DTYPE` runs on here."""
    from metronome.model import native
    from metronome.model.dtypes import resolve_dtype

    return {"model": model, "dtype": str(resolve_dtype(dtype)).removeprefix("torch."),
            "engine_path": "fast" if native.kernel() is not None else
            f"fast without the paged kernel ({native.unavailable_reason()})"}


class Server:
    def __init__(self, url: str, args: list[str], process=None, thread=None,
                 threads: int | None = None) -> None:
        self.url, self.args, self.process, self.thread = url, args, process, thread
        self.threads, self.start_s = threads, 0.0  # start_s: command to ready

    @classmethod
    def start(cls, serve_args: list[str], ready=healthy, log_path: Path | None = None,
              timeout_s: float = 180.0, threads: int | None = 1) -> Server:
        """`metronome serve <serve_args> --port <free>` with torch on `threads` (None: the
        machine's), its output to `log_path` (None: stderr only), once `ready(url)`."""
        args = [*TEXT_SERVER_ARGS, *serve_args, "--port", str(free_port())]
        started = time.monotonic()
        env = os.environ | ({} if threads is None else {"OMP_NUM_THREADS": str(threads),
                                                         "MKL_NUM_THREADS": str(threads)})
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        with (log_path.open("w") if log_path else open(os.devnull, "w")) as log:
            process = subprocess.Popen([*SERVE, *args], env=env, stdout=log,
                                       stderr=log if log_path else None)
        server = cls(f"http://127.0.0.1:{args[-1]}", args, process, threads=threads)
        while not ready(server.url):
            if process.poll() is not None or time.monotonic() - started > timeout_s:
                process.kill()
                raise RuntimeError(f"`{server.command}` did not come up within {timeout_s:g} s "
                                   f"(exit code {process.poll()}); see {log_path or 'stderr'}")
            time.sleep(0.25)
        server.start_s = time.monotonic() - started
        return server

    @classmethod
    def in_process(cls, config, model=None, tokenizer=None, **app_options) -> Server:
        from metronome.serve.server import ServerThread

        thread = ServerThread(config, model, tokenizer, **app_options).__enter__()
        return cls(thread.url, ["(in this process)"], thread=thread)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws") + "/v1/realtime"

    @property
    def command(self) -> str:
        """As a reader would type it, with the environment it ran with."""
        env = "" if self.threads is None else f"OMP_NUM_THREADS={self.threads} "
        return f"{env}metronome serve {' '.join(self.args)}"

    def stop(self) -> None:
        """The thread's exit, or SIGTERM (killed after 60 s)."""
        if self.thread is not None:
            return self.thread.__exit__(None, None, None)
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
