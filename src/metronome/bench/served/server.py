"""A `metronome serve` subprocess for a bench: start it, wait until it answers, stop it, and
say what it serves on (model, dtype, engine path) for the result's provenance."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from metronome.serve.config import ServerConfig

METRONOME = str(Path(sys.executable).parent / "metronome")
# torch (and OpenMP) on one thread in every bench server: benches that start several share
# the machine's cores predictably; the soak measures flatness, not speed
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


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


def served_facts(config: ServerConfig) -> dict:
    """What a server of `config` runs on, as `RunContext.record` takes it: the model, the
    dtype `auto` resolves to here and the engine path (the servers run the default "fast"
    path, which falls back to dense attention where the paged kernel does not build)."""
    from metronome.model import native
    from metronome.model.dtypes import resolve_dtype

    path = "fast" if native.kernel() is not None else (
        f"fast without the paged kernel ({native.unavailable_reason()})")
    return {"model": config.model, "engine_path": path,
            "dtype": str(resolve_dtype(config.dtype)).removeprefix("torch.")}


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    args: list[str]  # `metronome serve ...` as run (the port included)
    start_s: float  # command to ready

    @classmethod
    def start(cls, serve_args: list[str], ready: Callable[[str], bool] = healthy,
              log_path: Path | None = None, timeout_s: float = 180.0) -> ServerProcess:
        """`metronome serve <serve_args> --port <free>` on one thread, its stdout and stderr
        to `log_path` (None: stdout dropped, stderr shown); returns once `ready(url)`."""
        port = free_port()
        args = ["serve", *serve_args, "--port", str(port)]
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        with (log_path.open("w") if log_path else open(os.devnull, "w")) as log:
            process = subprocess.Popen([METRONOME, *args], env=os.environ | SINGLE_THREAD,
                                       stdout=log, stderr=log if log_path else None)
        while not ready(url):
            if process.poll() is not None or time.monotonic() - started > timeout_s:
                process.kill()
                raise RuntimeError(f"`metronome {' '.join(args)}` did not come up within "
                                   f"{timeout_s:g} s (exit code {process.poll()})"
                                   + (f": see {log_path}" if log_path else ""))
            time.sleep(0.25)
        return cls(process, url, args, time.monotonic() - started)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws") + "/v1/realtime"

    @property
    def command(self) -> str:
        """The command as a reader would type it, the environment it ran with included."""
        env = " ".join(f"{k}={v}" for k, v in SINGLE_THREAD.items())
        return f"{env} metronome {' '.join(self.args)}"

    def stop(self) -> float:
        """SIGTERM; seconds to exit (killed after 60 s)."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return time.monotonic() - started
