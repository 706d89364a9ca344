"""One reply's voice: its text as the model writes it, spoken sentence by sentence.

The reply pushes its text as each engine step brings tokens; each whole sentence
(`audio.voice.Sentences`) is spoken by Piper on the speak stage (one thread for every
session, its ONNX Runtime on 2 threads that yield; never the loop or the engine thread), and
comes back to the loop in order as the sentence and its PCM16 (`SpeechListener.on_said`). So
the first audio goes out while the model still writes the next sentence. `finish` (the
reply's frame is answered) flushes the rest; once the last sentence is out, the listener
hears `on_voice_done`. `cancel` (barge-in, `response.cancel`) stops it at once: sentences
queued on the stage are dropped unspoken, what is being spoken is dropped when it comes back,
and the listener hears `on_voice_done` once it was finished.

**By deadline.** Every session's replies share the one speak thread, and the model writes
far faster than anyone listens, so a long reply queues many sentences at once. Each sentence
goes to the stage with the time its listener would run dry without it
(`SpeechListener.sentence_due_s`, from the audio sent and the queued sentences' length at
`SPOKEN_CHARS_PER_S`), so a reply whose listener has seconds left yields to a neighbour's
first sentence; a reply's own deadlines never decrease, so its sentences stay in order.

Text and PCM only: what they become on the wire is the reply's (`serve.realtime.reply`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Protocol

from metronome.audio.voice import Sentences, Voice
from metronome.serve.voice.stage import Stage

log = logging.getLogger(__name__)

# Piper's joe-medium speaks 15-20 characters a second (measured: 14.6-20.4 over five
# sentences, 6.5 for a one-word one); the faster end makes the deadline earlier, not later
SPOKEN_CHARS_PER_S = 18.0
# ... and synthesizes at 12-18x real time on one of these cores: a sentence must start
# this much of its own playing time before it is due
SYNTHESIS_REALTIME_FACTOR = 12.0


class SpeechListener(Protocol):
    """Who hears a reply's voice (`serve.realtime.reply.Reply`), on the loop."""

    def on_said(self, sentence: str, pcm: bytes) -> None:
        """A sentence spoken: PCM16 at the voice's rate, in the order the text came."""

    def on_voice_done(self) -> None:
        """The voice is finished and has said everything (or was cancelled)."""

    def on_voice_failed(self) -> None:
        """Speaking a sentence raised (logged): the reply cannot go on."""

    def sentence_due_s(self, queued_audio_s: float) -> float:
        """When the listener runs dry if the next piece comes after `queued_audio_s` of audio
        still being spoken (the loop's clock): its first audio's due time plus that, before
        any audio went out."""


class Speaking:
    def __init__(self, stage: Stage[Voice], rate_hz: int, listener: SpeechListener,
                 by_deadline: bool = True) -> None:
        """`by_deadline` False: its sentences go in call order (`--speak-order arrival`)."""
        self.by_deadline = by_deadline
        self.stage = stage
        self.rate_hz = rate_hz
        self.listener = listener
        self._sentences = Sentences()
        self.text = ""  # everything the model wrote
        self.cancelled = False
        self._finished = False
        self._pending: dict[asyncio.Future[bytes], float] = {}  # on the stage: audio s est.
        self._last_due_s = -math.inf
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
        """Stop at once: nothing more is said (sentences not begun never run)."""
        self.cancelled = True
        for future in list(self._pending):
            future.cancel()  # its callback (`_said`) comes on the loop
        self._maybe_done()

    @property
    def finishing(self) -> bool:
        """The reply's text is all written: only the voice is still at work."""
        return self._finished

    @property
    def done(self) -> bool:
        return self._finished and (self.cancelled or not self._pending)

    def _say(self, sentence: str) -> None:
        rate_hz = self.rate_hz
        audio_s = len(sentence) / SPOKEN_CHARS_PER_S
        due_s = self._due_s(audio_s) if self.by_deadline else -math.inf  # -inf: call order

        def speak(voice: Voice) -> bytes:  # on the stage
            start = time.perf_counter()
            pcm = voice.speak(sentence, rate_hz)
            self.stage.observe(time.perf_counter() - start)
            return pcm

        future = self.stage.run_model(speak, due_s)
        self._pending[future] = audio_s
        future.add_done_callback(lambda done: self._said(sentence, done))

    def _due_s(self, audio_s: float) -> float:
        """When a sentence of ~`audio_s` must start: its listener runs dry after the audio
        sent and the sentences still on the stage, less its own synthesis; never before this
        reply's previous sentence."""
        queued_s = sum(self._pending.values())
        self._last_due_s = max(self._last_due_s, self.listener.sentence_due_s(queued_s)
                               - audio_s / SYNTHESIS_REALTIME_FACTOR)
        return self._last_due_s

    def _said(self, sentence: str, done: asyncio.Future[bytes]) -> None:
        del self._pending[done]
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
