"""What the cluster tests do as a client of `metronome serve --replicas`: wait, read the
cluster view, open sessions, stream speech and see how a session ended."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from metronome.bench.server import TEXT_SERVER_ARGS
from metronome.serve.protocol import with_extensions
from tests.served import free_port, server_process
from tests.streamer import SpeechStreamer

METRONOME = str(Path(sys.executable).parent / "metronome")


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


@contextmanager
def launched_cluster(tmp_path_factory, args: list[str], replicas_live: int, timeout_s: float,
                     name: str = "cluster") -> Iterator[tuple[str, Path]]:
    """`metronome serve` with `args` on a free port, until `replicas_live` replicas report:
    its URL and the file its launcher prints to (read `ray_address` from it)."""
    port = free_port()
    command = [METRONOME, "serve", *TEXT_SERVER_ARGS, *args, "--port", str(port),
               "--log-level", "info"]
    printed = tmp_path_factory.mktemp(name) / "stdout.txt"
    with printed.open("w") as out, server_process(command, port, stdout=out) as url:
        wait_for(lambda: view(url)["replicas_live"] == replicas_live, timeout_s,
                 f"{replicas_live} replicas' reports")
        yield url, printed


def ray_address(printed: Path) -> str:
    """The Ray address the launcher printed (`Ray at ...`)."""
    return wait_for(lambda: re.findall(r"Ray at (\S+)", printed.read_text()), 10,
                    "the launcher's banner")[0]


def scale(address: str, replicas: int) -> None:
    """`metronome cluster scale` on the cluster at Ray `address`."""
    scaled = subprocess.run([METRONOME, "cluster", "scale", str(replicas), "--ray-address",
                             address], timeout=60, capture_output=True, text=True)
    assert scaled.returncode == 0, scaled.stderr[-3000:]


def view(url: str) -> dict:
    return httpx.get(url + "/v1/cluster", timeout=5).json()


def actives(url: str) -> list[int]:
    return sorted(r["active_sessions"] for r in view(url)["replicas"])


def live(url: str) -> dict[str, dict]:
    """The replicas reporting, by id (a killed one is listed `unreachable` for a while)."""
    return {r["replica"]: r for r in view(url)["replicas"] if r["status"] != "unreachable"}


def live_actives(url: str) -> list[int]:
    return sorted(r["active_sessions"] for r in live(url).values())


def open_session(ws_url: str):
    """A session opted in to `metronome.*` events: the query string reaches the replica
    through Ray's proxy (its `session.created` carries the extension block)."""
    ws = connect(with_extensions(ws_url), open_timeout=10)
    created = json.loads(ws.recv(timeout=10))
    assert created["type"] == "session.created" and "metronome" in created["session"]
    return ws


def open_session_retrying(ws_url: str, attempts: int = 3):
    """`open_session` as a client at capacity does it: on HTTP 503, wait the Retry-After and
    try again. The router ranks by the stats each replica last reported (a stats period plus
    delivery behind), so a session opened just after another closed can still be placed on
    a full replica and refused; the next try, a report later, finds the room."""
    for attempt in range(attempts):
        try:
            return open_session(ws_url)
        except InvalidStatus as refused:
            response = refused.response
            if response.status_code != 503 or attempt == attempts - 1:
                raise
            time.sleep(float(response.headers["Retry-After"]))


def closed_within(ws, timeout_s: float) -> bool:
    try:
        while True:
            ws.recv(timeout=timeout_s)
    except ConnectionClosed:
        return True
    except TimeoutError:
        return False


class DrainedStreamer(SpeechStreamer):
    """A SpeechStreamer that notes when and how its socket closed."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.closed_at_s: float | None = None

    def _send(self) -> None:
        try:
            super()._send()
        except ConnectionClosed:
            pass

    def _receive(self) -> None:
        try:
            super()._receive()
        except ConnectionClosed:
            pass
        self.closed_at_s = time.monotonic()

    def stop(self) -> int:
        if self.closed_at_s is None:
            return super().stop()
        self._stop.set()
        self._sender.join()
        return 0

    def frames_after(self, t_s: float) -> int:
        return sum(1 for f in self.frames if f["received_at_s"] >= t_s)


class Stamped(list):
    def append(self, frame: dict) -> None:  # the client's clock at each frame result
        super().append(frame | {"received_at_s": time.monotonic()})
