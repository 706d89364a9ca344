"""A real server process for tests: `metronome serve` semantics in a subprocess, so the test
client's own Python (and its GIL) never shares the server's CPU time slices; and what the
tests read from any running server (in a subprocess or a `ServerThread`): its events and
its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from metronome.bench.server import free_port, healthy
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import EXTENSIONS_QUERY
from tests.conformance import check_server_event

STARTUP_TIMEOUT_S = 120.0  # a first start converts the bundled model

# The server these suites were written against, before the voice defaults: audio is the
# embedding front end's (one KV entry per audio token), replies are text and the client
# commits. They test the engine, the beat and the wire, not hearing or speaking (the voice
# suites do: tests/serve/test_voice*.py), and skip loading Whisper and Piper. TEXT_SERVER
# leaves the mode to the caller; TEXT_DUPLEX is the old default mode too.
TEXT_SERVER = {"audio_input": "embeddings", "output_audio": False, "server_vad": False,
               "max_response_tokens": 16}  # short replies: these suites check events
TEXT_DUPLEX = TEXT_SERVER | {"mode": "duplex"}


def recv(ws, timeout_s: float = 10.0) -> dict:
    """The next event; every one is checked against OpenAI's schema (`conformance`), and a
    `metronome.*` one must have been asked for."""
    event = json.loads(ws.recv(timeout=timeout_s))
    extended = EXTENSIONS_QUERY in ws.request.path
    check_server_event(event, extensions=extended)
    return event



def recv_until(ws, event_type: str, count: int = 1, timeout_s: float = 10.0) -> list[dict]:
    """Every event up to and including the `count`-th of `event_type`."""
    events = []
    while sum(e["type"] == event_type for e in events) < count:
        events.append(recv(ws, timeout_s))
    return events


def context_in(server, session_id: str, timeout_s: float = 30.0) -> None:
    """Until an in-process server (`ServerThread`) has processed all of the session's queued
    input: a turn session's text items and instructions are context, answered by no frame.
    Call it once the input is queued (its acknowledgment received: `session.updated`,
    `conversation.item.done`): before that there is nothing queued to wait for."""
    stream = server.app.state.serving.beat.streams[session_id]
    deadline = time.monotonic() + timeout_s
    while stream.queued_input_tokens:
        assert time.monotonic() < deadline, f"{stream!r}: its input still queued"
        time.sleep(0.01)


def metric(server, name: str, **labels: str) -> float:
    """Sample `name` with `labels` of `server`'s /metrics (`server.url`: its base URL)."""
    for sample in metric_samples(server, name):
        if all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise KeyError(name)


def metric_samples(server, name: str, headers: dict | None = None) -> list:
    """Every sample named `name` in one scrape of `server`'s /metrics (`headers`: e.g. its
    key), e.g. a histogram's buckets, read at one instant."""
    text = httpx.get(server.url + "/metrics", headers=headers).text
    return [sample for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name]


@contextmanager
def server_process(command: list[str], port: int, env: dict | None = None,
                   stdout=None) -> Iterator[str]:
    """Start `command` (a server on 127.0.0.1:`port`; its stdout to `stdout`, a file, if
    given), wait for /healthz; yields its URL."""
    process = subprocess.Popen(command, env=os.environ | (env or {}), stdout=stdout)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not healthy(url, timeout_s=1.0):
            assert process.poll() is None, "the server process exited"
            assert time.monotonic() < deadline, "the server process did not come up"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def served(config: ServerConfig, env: dict | None = None) -> Iterator[str]:
    """`config` (its port replaced by a free one) served by `serve_forever` in a subprocess
    (with `env` added to its environment)."""
    port = free_port()
    config = config.model_copy(update={"port": port,  # and a health listener of its own
                                       "health_port": config.health_port or free_port()})
    program = ("import sys; from metronome.serve.config import ServerConfig; "
               "from metronome.serve.server import serve_forever; "
               "serve_forever(ServerConfig.model_validate_json(sys.argv[1]), 'warning')")
    settings = config.model_dump(mode="json")  # which masks the key: pass it as it is
    if config.api_key is not None:
        settings["api_key"] = config.api_key.get_secret_value()
    command = [sys.executable, "-c", program, json.dumps(settings)]
    with server_process(command, port, env) as url:
        yield url


# The hostile suites' attackers run on the server's own 2 cores (loopback), which a deployed
# attacker never does: a flooding client holds a core for seconds, and libgomp's default
# spin-waiting then turns a ~100 ms step into ~1 s (docs/results/engine.md: spinning costs
# 1.8-2.85x passive waiting with one core busy). Those servers wait passively, so a late frame
# measures the server's handling of the attack, not the test client's CPU use.
SHARED_CPU_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
