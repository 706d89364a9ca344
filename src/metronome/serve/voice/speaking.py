"""One reply's voice: its text as the model writes it, spoken sentence by sentence.

The reply pushes its text as each engine step brings tokens; each whole sentence
(`audio.voice.Sentences`) is spoken by Piper on the speak stage (one thread for every
session, its ONNX Runtime on 2 threads that yield; never the loop or the engine thread), and
comes back to the loop in order as the sentence and its PCM16 (`SpeechListener.on_said`). So
the first audio goes out while the model still writes the next sentence. `finish` (the
reply's frame is answered) flushes the rest; once the last sentence is out, the listener
hears `on_voice_done`. `cancel` (barge-in, `response.cancel`) stops it at once: what is
still being spoken is dropped when it comes back, and the listener hears `on_voice_done`
once it was finished.

Text and PCM only: what they become on the wire is the reply's (`serve.realtime.reply`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from metronome.audio.voice import Sentences, Voice
from metronome.serve.voice.stage import Stage

log = logging.getLogger(__name__)


class SpeechListener(Protocol):
    """Who hears a reply's voice (`serve.realtime.reply.Reply`), on the loop."""

    def on_said(self, sentence: str, pcm: bytes) -> None:
        """A sentence spoken: PCM16 at the voice's rate, in the order the text came."""

    def on_voice_done(self) -> None:
        """The voice is finished and has said everything (or was cancelled)."""

    def on_voice_failed(self) -> None:
        """Speaking a sentence raised (logged): the reply cannot go on."""


class Speaking:
    def __init__(self, stage: Stage[Voice], rate_hz: int, listener: SpeechListener) -> None:
        self.stage = stage
        self.rate_hz = rate_hz
        self.listener = listener
        self._sentences = Sentences()
        self.text = ""  # everything the model wrote
        self.cancelled = False
        self._finished = False
        self._pending = 0  # sentences on the stage
        self._told_done = False

    def push(self, text: str) -> None:
        """More of the reply's text (a step's tokens, decoded)."""
        if self.cancelled or not text:
            return
        self.text += text
        for sentence in self._sentences.push(text):
            self._say(sentence)

    def finish(self) -> None:
        """The reply is complete: speak the rest, then tell the listener (at once if nothing
        is due)."""
        self._finished = True
        if not self.cancelled:
            for sentence in self._sentences.flush():
                self._say(sentence)
        self._maybe_done()

    def cancel(self) -> None:
        """Stop at once: nothing more is said."""
        self.cancelled = True
        self._maybe_done()

    @property
    def finishing(self) -> bool:
        """The reply's text is all written: only the voice is still at work."""
        return self._finished

    @property
    def done(self) -> bool:
        return self._finished and (self.cancelled or not self._pending)

    def _say(self, sentence: str) -> None:
        self._pending += 1
        rate_hz = self.rate_hz

        def speak(voice: Voice) -> bytes:  # on the stage
            start = time.perf_counter()
            pcm = voice.speak(sentence, rate_hz)
            self.stage.observe(time.perf_counter() - start)
            return pcm

        self.stage.run_model(speak).add_done_callback(lambda done: self._said(sentence, done))

    def _said(self, sentence: str, done: asyncio.Future[bytes]) -> None:
        self._pending -= 1
        if done.cancelled() or self.cancelled:
            self._maybe_done()
            return
        if done.exception() is not None:
            log.error("speaking a sentence failed", exc_info=done.exception())
            self.cancelled = True
            self.listener.on_voice_failed()
            return
        self.listener.on_said(sentence, done.result())
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.done and not self._told_done:
            self._told_done = True
            self.listener.on_voice_done()
