"""`metronome serve` in a subprocess on 127.0.0.1 (bearer key on), driven by the official
`openai` SDK realtime client and by `metronome load`."""

from __future__ import annotations

import asyncio
import base64
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import AsyncOpenAI
from served import free_port, server_process

from metronome.bench.server import TEXT_SERVER_ARGS
from metronome.load.run import LoadConfig, run_load
from metronome.load.speech import SPEECH_DIR, speech_stream

pytestmark = [pytest.mark.model, pytest.mark.wall_clock]
AUDIO_DIR = SPEECH_DIR
API_KEY = "sk-metronome-test"


@pytest.fixture(scope="module")
def server_url():
    port = free_port()
    command = [str(Path(sys.executable).parent / "metronome"), "serve", *TEXT_SERVER_ARGS,
               "--port", str(port),
               "--pool-tokens", "4096", "--admission", "off", "--log-level", "warning",
               "--deadline-fraction", "2.0"]  # a 16-token turn reply on fp32 here: ~1 s
    with server_process(command, port, env={"METRONOME_API_KEY": API_KEY}) as url:
        yield url


def sdk_client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(api_key=API_KEY, websocket_base_url=url.replace("http", "ws") + "/v1")


async def _duplex(url: str) -> list:
    async with sdk_client(url).realtime.connect(model="metronome") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "output_modalities": ["text"],
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}})
        updated = await conn.recv()
        assert updated.type == "session.updated"
        pcm = speech_stream(AUDIO_DIR, 24000, 2.0)
        for offset in range(0, len(pcm), 9600):  # 100 ms appends at real-time pace, no commit
            await conn.input_audio_buffer.append(
                audio=base64.b64encode(pcm[offset: offset + 9600]).decode())
            await asyncio.sleep(0.1)
        events, done = [], 0
        while done < 2:
            events.append(await asyncio.wait_for(conn.recv(), 30))
            done += events[-1].type == "response.done"
        return events


def test_openai_sdk_streams_text_deltas_from_appended_audio(server_url):
    events = asyncio.run(_duplex(server_url))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    done = [e for e in events if e.type == "response.done"]
    assert deltas and all(d.delta for d in deltas)
    assert [d.response.status for d in done] == ["completed", "completed"]
    text = "".join(d.delta for d in deltas)
    assert text == "".join(d.response.output[0].content[0].text for d in done)


async def _turn(url: str):
    async with sdk_client(url).realtime.connect(model="metronome") as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "metronome": {"mode": "turn"}})
        assert (await conn.recv()).type == "session.updated"
        await conn.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "What is the capital of France?"}]})
        await conn.response.create()
        while (event := await asyncio.wait_for(conn.recv(), 30)).type != "response.done":
            pass
        return event


def test_openai_sdk_turn_mode_text_item_and_response(server_url):
    done = asyncio.run(_turn(server_url))
    assert done.response.status == "completed"
    assert "Paris" in done.response.output[0].content[0].text


def test_load_generator_measures_every_frame(server_url, tmp_path):
    config = LoadConfig(url=server_url.replace("http", "ws") + "/v1/realtime", sessions=2,
                        ramp_s=0.5, duration_s=3.0, api_key=API_KEY, out=str(tmp_path))
    summary = asyncio.run(run_load(config))
    assert summary["sessions"]["completed"] == 2 and summary["frames"] == 6
    assert summary["goodput_server"] == 1.0 and summary["errors"] == {}
    with (tmp_path / "frames.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 and (tmp_path / "summary.json").exists()
    for row in rows:  # the client sees the answer after the server had it ready
        assert float(row["client_latency_ms"]) >= float(row["server_latency_ms"])


def test_load_and_virtual_run_work_from_any_directory(server_url, tmp_path):
    """The CLI finds what it ships (speech fixtures, corpus) as package data, not through
    the working directory: run both commands from an empty temporary folder."""
    metronome = str(Path(sys.executable).parent / "metronome")
    load = subprocess.run(
        [metronome, "load", "--url", server_url.replace("http", "ws") + "/v1/realtime",
         "--sessions", "1", "--duration-s", "2", "--out", "load"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=os.environ | {"METRONOME_API_KEY": API_KEY})
    assert load.returncode == 0, load.stderr[-3000:]
    assert json.loads((tmp_path / "load" / "summary.json").read_text())["frames"] == 2
    run = subprocess.run(
        [metronome, "run", "--clock", "virtual", "--sessions", "2", "--duration-s", "3",
         "--out", "run"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["frames"] == 6 and summary["frames_by_status"]["ok"] == 6
