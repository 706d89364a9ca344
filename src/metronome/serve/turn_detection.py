"""One session's server VAD (`turn_detection: server_vad`): its audio to the VAD thread, the
turns it hears back to the session as events, on the loop.

Owns the session's VAD settings, its `VadStream`, whose state lives on the host's VAD
thread, and the item the speech under way will become. `push` (on the loop) queues the
audio there in arrival order, and the turn events of each push come back in the same order:
speech start is `input_audio_buffer.speech_started` (then, with `interrupt_response`, the
session cancels the response under way), speech stop is `speech_stopped`, then the session
ends the turn (commits the buffer as the turn's item and, if it should, creates a
response), as if the client had sent the commit and the `response.create`.
`prefix_padding_ms` only places the item's start in the events: all the audio reaches the
engine as frames. New settings are a new `TurnDetection` (a fresh stream from where the
audio stands); one stopped drops the results still on the VAD thread. The network runs in
ONNX Runtime, never on the loop and never on the engine's torch threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from metronome.audio.silero import SileroVad
from metronome.audio.turn_detector import SpeechStarted, SpeechStopped, TurnEvent
from metronome.audio.vad import VadStream
from metronome.serve import protocol as p
from metronome.serve.protocol import server as se

log = logging.getLogger(__name__)
T = TypeVar("T")


class VadHost(Protocol):
    def detect(self, work: Callable[[SileroVad], T]) -> asyncio.Future[T]:
        """Run `work` on the VAD thread with the shared network, in call order."""


class TurnTaker(Protocol):
    """The session whose turns these are."""

    @property
    def committed_ms(self) -> float:
        """The input stream's position at the last commit."""

    def emit(self, event: p.ServerEvent) -> None: ...

    def speech_started(self, start_ms: float) -> None:
        """Speech starts at `start_ms` of the input stream (prefix padding included)."""

    def speech_stopped(self, end_ms: float) -> None:
        """Speech ended at `end_ms` of the input stream (the silence after it confirmed it)."""

    def interrupt_response(self) -> None:
        """The user spoke: cancel the response under way, if any."""

    def end_turn(self, item_id: str) -> None:
        """The speech stopped: commit it as item `item_id` (unless the client did)."""


class TurnDetection:
    def __init__(self, settings: p.ServerVad, host: VadHost, sample_rate_hz: int,
                 origin_ms: float, session: TurnTaker,
                 on_failure: Callable[[], None]) -> None:
        self.settings = settings
        self.sample_rate_hz = sample_rate_hz
        self._host = host
        self._stream = VadStream(sample_rate_hz, settings.threshold,
                                 settings.silence_duration_ms, origin_ms)
        self._session = session
        self._on_failure = on_failure
        self._item_id: str | None = None  # the item the speech under way will become
        self.stopped = False

    def push(self, pcm: bytes) -> None:
        """The session's next audio (PCM16 at `sample_rate_hz`), as it arrived."""
        stream = self._stream
        self._host.detect(lambda model: stream.push(model, pcm)).add_done_callback(
            self._on_events)

    def stop(self) -> None:
        self.stopped = True

    def take_item_id(self) -> str | None:
        """The speech under way's item id, for a commit: it goes with the commit."""
        item_id, self._item_id = self._item_id, None
        return item_id

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

    def _on_turn(self, event: TurnEvent) -> None:
        settings, session = self.settings, self._session
        match event:
            case SpeechStarted():
                self._item_id = p.new_id("item")
                start_ms = max(session.committed_ms,
                               event.start_ms - settings.prefix_padding_ms)
                session.emit(se.InputAudioBufferSpeechStarted(audio_start_ms=round(start_ms),
                                                             item_id=self._item_id))
                session.speech_started(start_ms)
                if settings.interrupt_response:
                    session.interrupt_response()
            case SpeechStopped():
                item_id = self._item_id or p.new_id("item")  # or a client commit took it
                end_ms = event.end_ms + settings.silence_duration_ms
                session.emit(se.InputAudioBufferSpeechStopped(audio_end_ms=round(end_ms),
                                                             item_id=item_id))
                session.speech_stopped(event.end_ms)
                session.end_turn(item_id)
