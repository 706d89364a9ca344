"""One session's ears: a turn's audio, heard by Whisper as it arrives, becomes its words.

Each audio frame of a turn is heard on the hear stage (`StreamingTranscript`): the words two
passes agree on are committed, and the turn's last frame (the commit) commits the rest. A
pass is speculative work, shed first: a frame whose partial pass would hear the same turn
with less audio than a newer frame queued behind it, or that waited for the stage longer
than `PARTIAL_PASS_MAX_WAIT_S` (the stage is behind), keeps its audio and skips its pass, so
a turn's last pass is never queued behind others' speculation. Under load the words arrive
later, never wrong. When server VAD hears a pause (`--hear-ahead-pause-ms`: 200 ms of
silence), the turn's last pass runs at once (`hear_ahead`), in the silence that may confirm
the turn's end: if it does, the commit finds the turn heard and the reply starts one pass
sooner.

Words only: what they become in the conversation (the user message's framing, its tokens,
its transcription events) is the Realtime session's (`serve.realtime`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from metronome.audio.pcm import decode_pcm16_array
from metronome.audio.whisper import StreamingTranscript, Whisper

PARTIAL_PASS_MAX_WAIT_S = 0.1  # a frame that waited longer for the stage skips its partial pass


@dataclass
class Heard:
    """What one frame's pass committed."""

    words: list[str] = field(default_factory=list)
    final: bool = False
    passed: bool = False  # a Whisper pass ran for it (not shed, not skipped)


class Hearing:
    def __init__(self, whisper: Whisper, sample_rate_hz: int) -> None:
        self.transcript = StreamingTranscript(whisper, sample_rate_hz)  # the stage's only
        self.sample_rate_hz = sample_rate_hz
        self.latest_cut_ms = 0.0  # the loop's: the end of the newest frame queued

    def hear(self, pcm: bytes, final: bool, audio_end_ms: float, speech_from_ms: float | None,
             queued_at_s: float, speech_end_ms: float | None = None) -> Heard:
        """On the hear stage: one frame's audio heard, and the words it commits.
        `speech_from_ms`: where its turn's speech starts, as the loop knew when it queued
        the frame (None: no speech yet); `queued_at_s`: `time.monotonic()` then;
        `speech_end_ms`: where server VAD placed the turn's end (a final frame)."""
        samples = decode_pcm16_array(pcm)
        pass_now = final or self._speculation_pays(audio_end_ms, queued_at_s)
        passes = self.transcript.passes
        words = self.transcript.push(samples, audio_end_ms, final, speech_from_ms, pass_now,
                                     speech_end_ms)
        return Heard(words, final, passed=self.transcript.passes > passes)

    def hear_ahead(self, pcm: bytes, audio_end_ms: float, speech_from_ms: float,
                   queued_at_s: float) -> bool:
        """On the hear stage: server VAD heard a pause in the turn; its last pass runs on the
        audio so far (`pcm`: the bytes not cut into a frame yet), so that a commit at the
        pause finds the turn heard (`StreamingTranscript.hear_ahead`). Speculative work,
        shed as a partial pass is: not if a frame was cut since or the stage is behind.
        Whether a pass ran."""
        if not self._speculation_pays(audio_end_ms, queued_at_s):
            return False
        self.transcript.hear_ahead(decode_pcm16_array(pcm), audio_end_ms, speech_from_ms)
        return True

    def _speculation_pays(self, audio_end_ms: float, queued_at_s: float) -> bool:
        """A speculative pass over audio up to `audio_end_ms`, queued at `queued_at_s`, runs:
        no newer frame was cut (its pass will hear more) and the stage is not behind."""
        return (self.latest_cut_ms <= audio_end_ms
                and time.monotonic() - queued_at_s <= PARTIAL_PASS_MAX_WAIT_S)
