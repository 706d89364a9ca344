"""Audio encoding runs off the event loop: one session's audio never delays another session's
deadline timers. The encoder is made slow on purpose (300 ms a frame, 3 frames); a loop timer
due meanwhile must fire within TIMER_LAG_BOUND_S of its time. With encoding on the loop it
fired ~0.9 s late."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

from metronome.engine.engine import Engine
from metronome.serve import protocol as p
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import ClientError
from metronome.serve.protocol import server as se
from metronome.serve.realtime import input_buffer as session_module
from metronome.serve.realtime.audio_input import AudioFramer
from metronome.serve.realtime.session import RealtimeSession
from metronome.serve.serving import Serving
from tests.serve.session_client import RecordingClient
from tests.served import TEXT_DUPLEX

SLOW_ENCODE_S = 0.3
TIMER_LAG_BOUND_S = 0.05


def test_a_slow_audio_encoder_does_not_delay_the_loop(tiny_model, monkeypatch):
    real_encode = AudioFramer.encode

    def slow_encode(self, pcm, final=False):
        time.sleep(SLOW_ENCODE_S)  # a heavy encoder, on whichever thread runs it
        return real_encode(self, pcm, final)

    monkeypatch.setattr(AudioFramer, "encode", slow_encode)
    config = ServerConfig(**TEXT_DUPLEX,
                          policy="sinks_window:4:64", pool_tokens=4096, admission="off",
                          sample_rates_hz=(16000,), default_sample_rate_hz=16000)

    async def scenario():
        state = Serving(config, Engine(tiny_model, config.engine_config()), None, None,
                            "tiny")
        try:
            events: list[p.ServerEvent] = []
            streamer = RealtimeSession(state, RecordingClient(events), extensions=True)
            loop = asyncio.get_running_loop()
            fired = loop.create_future()
            due_s = loop.time() + 0.1
            loop.call_at(due_s, lambda: fired.set_result(loop.time() - due_s))
            pcm = b"\x10\x00" * 16000 * 3  # 3 s: three frames to encode
            streamer.handle(p.InputAudioBufferAppend(type="input_audio_buffer.append",
                                                     audio=_b64(pcm)))
            lag_s = await fired
            while sum(isinstance(e, se.MetronomeFrame) for e in events) < 3:
                await asyncio.sleep(0.05)  # the frames still get encoded and answered
            streamer.close()
            return lag_s, [e for e in events if isinstance(e, se.MetronomeFrame)]
        finally:
            state.close()

    lag_s, frames = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert lag_s < TIMER_LAG_BOUND_S, f"a loop timer fired {lag_s * 1e3:.0f} ms late"
    assert [f.frame.index for f in frames] == [0, 1, 2]  # in order, each answered once
    # the encoder's time counts in each frame's latency: arrival is when its bytes came
    assert all(f.frame.latency_ms >= SLOW_ENCODE_S * 1e3 * 0.9 for f in frames)


def _b64(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode()


def test_an_append_that_cannot_fit_is_refused_before_it_is_decoded(tiny_model, monkeypatch):
    """Decoding base64 costs the loop ~3 ms per MiB: a chunk whose decoded size (known from
    its length) is over the buffered-audio bound is refused without it; one that fits is
    decoded and checked exactly."""
    decoded: list[int] = []
    real_decode = session_module.decode_pcm16

    def counting_decode(audio_b64: str) -> bytes:
        decoded.append(len(audio_b64))
        return real_decode(audio_b64)

    monkeypatch.setattr(session_module, "decode_pcm16", counting_decode)
    config = ServerConfig(**TEXT_DUPLEX,
                          policy="sinks_window:4:64", pool_tokens=4096, admission="off",
                          sample_rates_hz=(16000,), default_sample_rate_hz=16000)

    async def scenario():
        state = Serving(config, Engine(tiny_model, config.engine_config()), None, None,
                            "tiny")
        try:
            session = RealtimeSession(state, RecordingClient())
            too_long = b"\x10\x00" * 16000 * 5  # 5 s: over the 4 s bound
            with pytest.raises(ClientError) as refused:
                session.handle(p.InputAudioBufferAppend(type="input_audio_buffer.append",
                                                        audio=_b64(too_long)))
            assert refused.value.code is p.ErrorCode.BUFFER_OVERFLOW
            assert decoded == []  # refused from its length alone
            session.handle(p.InputAudioBufferAppend(type="input_audio_buffer.append",
                                                    audio=_b64(b"\x10\x00" * 16000)))
            assert len(decoded) == 1
            session.close()
        finally:
            state.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
