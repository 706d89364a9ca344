"""Server VAD over the wire (`turn_detection: server_vad`): a client streaming the espeak-ng
fixtures at real time gets speech_started / speech_stopped at the fixtures' speech
boundaries (an energy gate's, within 100 ms), the buffer committed and a response created
without sending either, and its reply cancelled when it speaks over it. Bad settings are an
`error` and the session lives on; null settings give back client commits. VAD work runs
on its own thread, never on the loop, and leaves torch's thread count alone."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import threading
import time
from functools import partial

import pytest
import torch
from websockets.sync.client import connect

from metronome.audio.vad import VadStream
from metronome.engine.engine import Engine
from metronome.load.speech import speech_spans_ms, to_pcm16, utterances
from metronome.model.weights import load_tokenizer
from metronome.serve import protocol as p
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import server as se
from metronome.serve.protocol import with_extensions
from metronome.serve.realtime.session import RealtimeSession
from metronome.serve.server import ServerThread
from metronome.serve.serving import Serving
from tests import served
from tests.serve.session_client import RecordingClient
from tests.served import TEXT_DUPLEX

pytestmark = pytest.mark.wall_clock

RATE_HZ = 24000  # the OpenAI Realtime default
TOLERANCE_MS = 100.0
CHUNK_S = 0.1  # the client appends 100 ms at a time, at real time
PREFIX_MS, SILENCE_MS = 200, 400
VAD = {"type": "server_vad", "prefix_padding_ms": PREFIX_MS, "silence_duration_ms": SILENCE_MS}
# Two frames may wait on each other on this 2-core CPU (fp32): 2 s deadlines keep them honest.
SMALL = TEXT_DUPLEX | {"pool_tokens": 4096, "admission": "off", "deadline_fraction": 2.0}


def update(ws, turn_detection, mode: str | None = None) -> None:
    session: dict = {"audio": {"input": {"turn_detection": turn_detection}}}
    if mode is not None:
        session["metronome"] = {"mode": mode}
    ws.send(json.dumps({"type": "session.update", "session": session}))


def append(pcm: bytes) -> str:
    return json.dumps({"type": "input_audio_buffer.append",
                       "audio": base64.b64encode(pcm).decode()})


# turns through the VAD thread take longer than a plain reply under CI load
RECV_TIMEOUT_S = 15.0
recv = partial(served.recv, timeout_s=RECV_TIMEOUT_S)
recv_until = partial(served.recv_until, timeout_s=RECV_TIMEOUT_S)


class RealTimeSender(threading.Thread):
    """Appends `parts` of PCM in 100 ms chunks, each chunk when its last sample would have
    been spoken; a part may wait for `go` (a threading.Event), streaming silence meanwhile."""

    def __init__(self, ws, parts: list[tuple[bytes, threading.Event | None]]) -> None:
        super().__init__(daemon=True)
        self.ws, self.parts = ws, parts
        self.sent_ms: list[float] = []  # where each part began in the stream

    def run(self) -> None:
        step = round(RATE_HZ * CHUNK_S) * 2
        silence = bytes(step)
        sent_bytes, started = 0, time.monotonic()

        def send(chunk: bytes) -> None:
            nonlocal sent_bytes
            self.ws.send(append(chunk))
            sent_bytes += len(chunk)
            time.sleep(max(0.0, started + sent_bytes / 2 / RATE_HZ - time.monotonic()))

        for pcm, go in self.parts:
            while go is not None and not go.wait(0) and sent_bytes < 30 * 2 * RATE_HZ:
                send(silence)
            self.sent_ms.append(sent_bytes / 2 / RATE_HZ * 1000)
            for i in range(0, len(pcm), step):
                send(pcm[i:i + step])


def of_type(events: list[dict], event_type: str) -> list[dict]:
    return [e for e in events if e["type"] == event_type]


@pytest.fixture(scope="module")
def server(smollm2):
    with ServerThread(ServerConfig(**SMALL), smollm2, load_tokenizer()) as running:
        yield running


@pytest.mark.model
def test_server_vad_commits_and_responds_without_the_client(server):
    threads = torch.get_num_threads()
    samples = utterances(["weather", "booking"], RATE_HZ, [0.6, 1.5, 0.8])
    truth = speech_spans_ms(samples, RATE_HZ)
    assert len(truth) == 2
    with connect(server.ws_url) as ws:
        recv(ws)
        update(ws, VAD | {"interrupt_response": False}, mode="turn")
        described = recv(ws)["session"]["audio"]["input"]["turn_detection"]
        assert described == {"type": "server_vad", "threshold": 0.5,
                             "prefix_padding_ms": PREFIX_MS, "silence_duration_ms": SILENCE_MS,
                             "create_response": True, "interrupt_response": False,
                             "idle_timeout_ms": None}
        sender = RealTimeSender(ws, [(to_pcm16(samples), None)])
        sender.start()
        events = recv_until(ws, "response.done", count=2)
        sender.join()
    assert not of_type(events, "error")
    started, stopped = (of_type(events, "input_audio_buffer.speech_started"),
                        of_type(events, "input_audio_buffer.speech_stopped"))
    committed = of_type(events, "input_audio_buffer.committed")
    assert len(started) == len(stopped) == len(committed) == 2
    users = [e["item"]["id"] for e in of_type(events, "conversation.item.added")
             if e["item"]["role"] == "user"]
    assert users == [s["item_id"] for s in started]
    for turn, (true_start_ms, true_end_ms) in enumerate(truth):
        item_id = started[turn]["item_id"]
        assert stopped[turn]["item_id"] == committed[turn]["item_id"] == item_id
        # the events place the item: the speech's start less the prefix padding, its end
        # plus the silence that confirmed it
        assert abs(started[turn]["audio_start_ms"] + PREFIX_MS - true_start_ms) <= TOLERANCE_MS
        assert abs(stopped[turn]["audio_end_ms"] - SILENCE_MS - true_end_ms) <= TOLERANCE_MS
        kinds = [e["type"] for e in events]
        turn_events = [kinds.index("input_audio_buffer.speech_started"),
                       kinds.index("input_audio_buffer.speech_stopped"),
                       kinds.index("input_audio_buffer.committed"),
                       kinds.index("response.created")]
        assert turn_events == sorted(turn_events)
        events = events[kinds.index("response.created") + 1:]  # on to the next turn
    # the server process (this one) still runs torch on its threads; the package that would
    # have set them to 1 was never imported
    assert torch.get_num_threads() == threads
    assert "silero_vad" not in sys.modules


@pytest.mark.model
def test_speaking_over_the_reply_cancels_it(server):
    first = to_pcm16(utterances(["weather"], RATE_HZ, [0.6, 0.0]))
    second = to_pcm16(utterances(["station"], RATE_HZ, [0.0, 0.8]))
    replying = threading.Event()
    with connect(server.ws_url) as ws:
        recv(ws)
        update(ws, VAD, mode="turn")
        recv(ws)
        sender = RealTimeSender(ws, [(first, None), (second, replying)])
        sender.start()
        events = [recv(ws)]
        while len(of_type(events, "response.done")) < 2:
            events.append(recv(ws))
            if events[-1]["type"] == "response.created":
                replying.set()  # the user talks over the reply as soon as it starts
        sender.join()
    done = [e["response"] for e in of_type(events, "response.done")]
    assert done[0]["status"] == "cancelled"
    assert done[0]["status_details"] == {"type": "cancelled", "reason": "turn_detected",
                                         "error": None}
    # the next turn's reply runs to its end: the model's stop, or its budget (no deadline
    # cuts a turn's reply)
    assert done[1]["status"] == "completed" or (
        done[1]["status_details"]["reason"] == "max_output_tokens")
    kinds = [e["type"] for e in events]
    second_start = [i for i, k in enumerate(kinds) if k == "input_audio_buffer.speech_started"][1]
    assert second_start < kinds.index("response.done")  # the speech came first, then the cancel
    assert not of_type(events, "error")


@pytest.mark.model
@pytest.mark.parametrize("turn_detection, code, param", [
    (VAD | {"threshold": 1.5}, "invalid_value", "threshold"),
    (VAD | {"silence_duration_ms": -1}, "invalid_value", "silence_duration_ms"),
    (VAD | {"prefix_padding_ms": "300"}, "invalid_value", "prefix_padding_ms"),
    (VAD | {"create_response": "yes"}, "invalid_value", "create_response"),
    (VAD | {"idle_timeout_ms": 5000}, "invalid_value", "idle_timeout_ms"),
    (VAD | {"eagerness": "low"}, "unknown_parameter", "eagerness"),
    ({"type": "vad_of_the_future"}, "invalid_value", "type"),
    ({"threshold": 0.5}, "missing_required_parameter", "type"),
])
def test_bad_turn_detection_is_an_error_and_the_session_lives_on(server, turn_detection, code,
                                                                 param):
    with connect(server.ws_url) as ws:
        recv(ws)
        update(ws, turn_detection)
        error = recv(ws)["error"]
        assert (error["code"], error["param"]) == (
            code, f"session.audio.input.turn_detection.{param}")
        assert error["message"].startswith(error["param"])
        update(ws, VAD)  # the same session takes good settings next
        assert recv(ws)["session"]["audio"]["input"]["turn_detection"]["silence_duration_ms"] \
            == SILENCE_MS


@pytest.mark.model
def test_null_turn_detection_gives_back_client_commits(server):
    samples = utterances(["booking"], RATE_HZ, [0.5, 1.0])
    with connect(with_extensions(server.ws_url)) as ws:
        recv(ws)
        update(ws, VAD, mode="turn")
        recv(ws)
        update(ws, None)
        assert recv(ws)["session"]["audio"]["input"]["turn_detection"] is None
        ws.send(append(to_pcm16(samples)))  # 3 s of speech and silence, at once
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        events = recv_until(ws, "metronome.frame", count=4)
    kinds = {e["type"] for e in events}
    assert "input_audio_buffer.committed" in kinds and "response.created" not in kinds
    assert not {"input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"} & kinds


# ---- one session on a tiny model, on this test's loop ------------------------------------------
def run_session(tiny_model, scenario) -> object:
    config = ServerConfig(**TEXT_DUPLEX,
                          policy="sinks_window:4:64", pool_tokens=4096, admission="off",
                          sample_rates_hz=(16000,), default_sample_rate_hz=16000)

    async def main():
        state = Serving(config, Engine(tiny_model, config.engine_config()), None, None,
                            "tiny")
        try:
            events: list[p.ServerEvent] = []
            session = RealtimeSession(state, RecordingClient(events), extensions=True)
            try:
                return await scenario(session, events)
            finally:
                session.close()
        finally:
            state.close()

    return asyncio.run(asyncio.wait_for(main(), 30))


def vad_update(**settings) -> p.SessionUpdate:
    return p.SessionUpdate(type="session.update", session=p.SessionIn(audio=p.AudioIn(
        input=p.AudioInputIn(turn_detection=p.ServerVad(type="server_vad", **settings)))))


def append_event(pcm: bytes) -> p.InputAudioBufferAppend:
    return p.InputAudioBufferAppend(type="input_audio_buffer.append",
                                    audio=base64.b64encode(pcm).decode())


def test_vad_runs_on_its_own_thread_never_on_the_loop(tiny_model, monkeypatch):
    real_push, threads_seen = VadStream.push, set()

    def slow_push(self, model, pcm):
        threads_seen.add(threading.current_thread().name)
        time.sleep(0.3)  # a heavy detector, on whichever thread runs it
        return real_push(self, model, pcm)

    monkeypatch.setattr(VadStream, "push", slow_push)
    speech = to_pcm16(utterances(["weather"], 16000, [0.5, 0.7]))

    async def scenario(session, events):
        session.handle(vad_update(silence_duration_ms=300))  # duplex: no auto-response
        loop = asyncio.get_running_loop()
        fired, due_s = loop.create_future(), loop.time() + 0.1
        loop.call_at(due_s, lambda: fired.set_result(loop.time() - due_s))
        for i in range(0, len(speech), 16000):  # 0.5 s of audio a push, 0.3 s of VAD each
            session.handle(append_event(speech[i:i + 16000]))
        lag_s = await fired
        while not any(isinstance(e, se.InputAudioBufferCommitted) for e in events):
            await asyncio.sleep(0.05)
        return lag_s

    lag_s = run_session(tiny_model, scenario)
    assert lag_s < 0.05, f"a loop timer fired {lag_s * 1e3:.0f} ms late"
    assert {name.split("_")[0] for name in threads_seen} == {"metronome-vad"}


def test_a_model_without_a_tokenizer_cannot_auto_respond_in_turn_mode(tiny_model):
    async def scenario(session, events):
        update = vad_update()
        update.session.metronome = p.MetronomeSessionIn(mode="turn")
        with pytest.raises(p.ClientError) as refused:
            session.handle(update)
        update.session.audio.input.turn_detection.create_response = False
        session.handle(update)  # events only: fine without text
        return refused.value, events[-1]

    refused, updated = run_session(tiny_model, scenario)
    assert refused.code is p.ErrorCode.TEXT_UNSUPPORTED
    assert refused.param == "session.audio.input.turn_detection.create_response"
    assert updated.session.metronome.mode == "turn"
    assert updated.session.audio.input.turn_detection.create_response is False
