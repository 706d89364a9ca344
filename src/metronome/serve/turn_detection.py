"""One session's server VAD (`turn_detection: server_vad`): its audio to the VAD thread, the
turns it hears back to the session, on the loop.

Owns the session's settings and its `VadStream`, whose state lives on the host's VAD
thread: `push` (on the loop) queues the audio there in arrival order, and the turn events
of each push come back to `on_turn` in the same order. New settings are a new
`TurnDetection` (a fresh stream from where the audio stands); one stopped drops the results
still on the VAD thread. The network runs in ONNX Runtime, never on the loop and never on
the engine's torch threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from metronome.audio.silero import SileroVad
from metronome.audio.turn_detector import TurnEvent
from metronome.audio.vad import VadStream
from metronome.serve import protocol as p

log = logging.getLogger(__name__)
T = TypeVar("T")


class VadHost(Protocol):
    def detect(self, work: Callable[[SileroVad], T]) -> asyncio.Future[T]:
        """Run `work` on the VAD thread with the shared network, in call order."""


class TurnDetection:
    def __init__(self, settings: p.ServerVad, host: VadHost, sample_rate_hz: int,
                 origin_ms: float, on_turn: Callable[[TurnEvent], None],
                 on_failure: Callable[[], None]) -> None:
        self.settings = settings
        self.sample_rate_hz = sample_rate_hz
        self._host = host
        self._stream = VadStream(sample_rate_hz, settings.threshold,
                                 settings.silence_duration_ms, origin_ms)
        self._on_turn = on_turn
        self._on_failure = on_failure
        self.stopped = False

    def push(self, pcm: bytes) -> None:
        """The session's next audio (PCM16 at `sample_rate_hz`), as it arrived."""
        stream = self._stream
        self._host.detect(lambda model: stream.push(model, pcm)).add_done_callback(
            self._on_events)

    def stop(self) -> None:
        self.stopped = True

    def _on_events(self, done: asyncio.Future[list[TurnEvent]]) -> None:
        if self.stopped or done.cancelled():
            return  # new settings or a closed session: this stream's turns are moot
        if done.exception() is not None:
            log.error("server VAD failed", exc_info=done.exception())
            self.stopped = True
            self._on_failure()
            return
        for event in done.result():
            if self.stopped:  # a turn's handling may end the session
                return
            self._on_turn(event)
