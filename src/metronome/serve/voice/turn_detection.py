"""One session's turn detection: its audio to the VAD stage, the turns heard back as
`TurnEvent`s (`audio.turn_detector`: speech started, paused, stopped), in arrival order.

Owns the session's `VadStream`, whose state lives on the VAD stage's thread (the Silero
network runs there in ONNX Runtime, never on the loop and never on the engine's torch
threads). `push` queues the session's next audio and returns the future of the turn events
it completes; the futures resolve on the loop in push order. New settings are a new
`TurnDetection` (a fresh stream from where the audio stands); one `stop`ped is moot: its
events still to come are for nobody.

Events only: what a turn does to the session (its protocol events, the commit, a reply, a
barge-in) is the Realtime session's, which dispatches them beside the client's events.
"""

from __future__ import annotations

import asyncio

from metronome.audio.silero import SileroVad
from metronome.audio.turn_detector import TurnEvent
from metronome.audio.vad import VadStream
from metronome.serve.voice.stage import Stage


class TurnDetection:
    def __init__(self, stage: Stage[SileroVad], sample_rate_hz: int, threshold: float,
                 silence_duration_ms: float, origin_ms: float,
                 pause_ms: float | None = None, max_turn_ms: float | None = None) -> None:
        """`pause_ms`: also tell a pause in speech this long (`SpeechPaused`: a session that
        hears runs the turn's last pass there, ahead of the turn's end); `max_turn_ms`: the
        turn limit (`audio.turn_detector`)."""
        self.sample_rate_hz = sample_rate_hz
        self._stage = stage
        self._stream = VadStream(sample_rate_hz, threshold, silence_duration_ms, origin_ms,
                                 pause_ms, max_turn_ms)
        self.stopped = False

    def push(self, pcm: bytes) -> asyncio.Future[list[TurnEvent]]:
        """The session's next audio (PCM16 at `sample_rate_hz`), as it arrived."""
        stream = self._stream
        return self._stage.run_model(lambda model: stream.push(model, pcm))

    def stop(self) -> None:
        """Its events still to come are moot (new settings, a cleared buffer, a close)."""
        self.stopped = True
