"""One spoken response: its text as the model writes it, spoken sentence by sentence.

The session pushes the response's text as each engine step brings tokens (`Stream.on_tokens`);
each whole sentence (`audio.voice.Sentences`) is spoken by Piper on the server's voice thread
(one for every session, its ONNX Runtime on 2 threads that yield; never the loop or the
engine thread), and comes back to the loop in order as `response.output_audio_transcript.delta` (the
sentence) and `response.output_audio.delta` events (PCM16 at 24 kHz, in pieces of at most
`AUDIO_DELTA_MS`). So the first audio goes out while the model still writes the next
sentence. When the frame is answered the rest is flushed; once the last sentence is out,
`done` closes the response. `cancel` (barge-in, `response.cancel`) stops it at once: what is
still being spoken is dropped when it comes back and the response closes `cancelled`.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable

from metronome.audio.voice import Sentences, Voice
from metronome.serve.protocol import server as se
from metronome.serve.responses import Response

AUDIO_DELTA_MS = 500  # the largest piece of audio in one delta (24 KB of PCM16 at 24 kHz)


class Speech:
    def __init__(self, response: Response, voice: Voice, rate_hz: int,
                 speak: Callable[[Callable[[], bytes]], asyncio.Future],
                 emit: Callable[[se.ServerEvent], None],
                 on_voice_s: Callable[[float], None] = lambda seconds: None) -> None:
        self.response = response
        self.voice = voice
        self.rate_hz = rate_hz
        self._speak = speak  # runs work on the voice thread; futures resolve in order
        self._emit = emit
        self._on_voice_s = on_voice_s  # each sentence's synthesis time (the stage metric)
        self._sentences = Sentences()
        self.text = ""  # everything the model wrote
        self.spoken = ""  # the transcript of what went out as audio
        self.said: list[tuple[str, float]] = []  # each sentence that went out, its audio ms
        self.audio_bytes = 0
        self._pending = 0  # sentences on the voice thread
        self._finished = False  # no more text will come
        self._on_done: Callable[[], None] | None = None
        self.cancelled = False
        self.cancel_reason: str | None = None  # turn_detected or client_cancelled
        self.first_audio_at: float | None = None  # time.monotonic() of the first audio delta

    def push(self, text: str) -> None:
        """More of the reply's text (a step's tokens, decoded)."""
        if self.cancelled or not text:
            return
        self.text += text
        for sentence in self._sentences.push(text):
            self._say(sentence)

    def finish(self, on_done: Callable[[], None]) -> None:
        """The reply is complete: speak the rest, then `on_done` (at once if nothing is due)."""
        self._finished, self._on_done = True, on_done
        if not self.cancelled:
            for sentence in self._sentences.flush():
                self._say(sentence)
        self._maybe_done()

    def cancel(self, reason: str | None = None) -> None:
        """Stop at once: nothing more goes out; the response closes `cancelled` (`reason`)."""
        if not self.cancelled:
            self.cancelled, self.cancel_reason = True, reason
        self._maybe_done()

    @property
    def finishing(self) -> bool:
        """Its frame is answered: only the voice is still at work."""
        return self._finished

    @property
    def done(self) -> bool:
        return self._finished and (self.cancelled or not self._pending)

    def _say(self, sentence: str) -> None:
        self._pending += 1
        voice, rate_hz = self.voice, self.rate_hz

        def work() -> tuple[bytes, float]:
            start = time.perf_counter()
            pcm = voice.speak(sentence, rate_hz)
            return pcm, time.perf_counter() - start

        self._speak(work).add_done_callback(lambda done: self._said(sentence, done))

    def _said(self, sentence: str, done: asyncio.Future) -> None:
        self._pending -= 1
        if done.cancelled() or self.cancelled:
            self._maybe_done()
            return
        pcm, seconds = done.result()  # a synthesis error propagates: the session fails
        self._on_voice_s(seconds)
        rid, item_id = self.response.response_id, self.response.item_id
        piece = (" " if self.spoken else "") + sentence
        self.spoken += piece
        self._emit(se.ResponseOutputAudioTranscriptDelta(response_id=rid, item_id=item_id,
                                                         delta=piece))
        step = self.rate_hz * 2 * AUDIO_DELTA_MS // 1000
        for start in range(0, len(pcm), step):
            if self.first_audio_at is None:
                self.first_audio_at = time.monotonic()
            self._emit(se.ResponseOutputAudioDelta(
                response_id=rid, item_id=item_id,
                delta=base64.b64encode(pcm[start:start + step]).decode()))
        self.audio_bytes += len(pcm)
        self.said.append((sentence, len(pcm) / (2 * self.rate_hz) * 1000))
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.done and self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()
