"""The one server launcher against a tiny server: started on a free port and awaited until
it answers, its command as a reader would type it, stopped; a server that never comes up is
an error that says so."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from metronome.bench.server import TEXT_SERVER_ARGS, Server, healthy, served_facts
from metronome.load.client import Connection


def test_a_tiny_server_starts_answers_a_session_and_stops(tmp_path):
    with Server.start(["--model", "preset:tiny", "--log-level", "warning"],
                      log_path=tmp_path / "serve.log") as server:
        assert healthy(server.url) and server.start_s > 0
        # the text server's flags first (the preset's own come after them, and win)
        assert server.command.startswith("OMP_NUM_THREADS=1 metronome serve "
                                         f"{' '.join(TEXT_SERVER_ARGS)} --model preset:tiny")
        assert server.command.endswith(f"--port {server.url.rsplit(':', 1)[1]}")

        async def session() -> dict:
            conn = await Connection.open(server.ws_url)
            try:
                return conn.session
            finally:
                await conn.close()

        assert asyncio.run(session())["id"]
        pid = server.process.pid
    assert server.process.poll() is not None, f"process {pid} still runs"
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/healthz", timeout=1)


def test_a_server_that_never_comes_up_is_an_error_naming_its_command(tmp_path):
    with pytest.raises(RuntimeError, match="metronome serve .*--no-such-option .* did not come "
                       "up .*exit code [1-9]"):
        Server.start(["--no-such-option"], log_path=tmp_path / "serve.log", timeout_s=60)


def test_served_facts_name_the_model_and_the_dtype_auto_resolves_to():
    facts = served_facts("preset:tiny", "float32")
    assert facts["model"] == "preset:tiny" and facts["dtype"] == "float32"
    assert facts["engine_path"].startswith("fast")
