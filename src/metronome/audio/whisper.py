"""Hearing: Whisper tiny.en (CTranslate2, int8) and a streaming transcript over its passes.

`Whisper` is the model: 16 kHz float samples in, words out (one pass; every pass pads to
30 s, so its cost barely depends on the clip: ~0.35-0.5 s on 2 threads here). It runs on
the server's encoder thread, never on the loop or the engine's thread.

`StreamingTranscript` is one turn's transcript as its audio arrives (LocalAgreement-2, as
streaming-Whisper servers do): each pass transcribes the turn's audio so far; the words two
consecutive passes agree on, past what is committed, are committed, and never change again.
So when the user stops, most of the turn's words are already in the session's KV; the
final pass commits the rest. A pass that would only repeat one already queued behind it is
skipped (`push(..., pass_now=False)`): under load the transcript commits less often, it never
falls further behind than one pass.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from metronome.audio.carriers import whisper_model_dir
from metronome.audio.resample import StreamingResampler

WHISPER_RATE_HZ = 16000
WHISPER_MAX_S = 30.0  # one pass hears at most this much: a longer turn keeps its last 30 s
ROLLING_S = 3.0  # audio kept before speech is detected (VAD reports a frame or so late)
HEARD_THE_END_MS = 150.0  # a pass that heard this far past the speech's end heard it all


class Whisper:
    def __init__(self, cpu_threads: int = 1, beam_size: int = 1) -> None:
        from faster_whisper import WhisperModel  # imported here: ~0.3 s, only when hearing

        self.model = WhisperModel(str(whisper_model_dir()), device="cpu", compute_type="int8",
                                  cpu_threads=cpu_threads, num_workers=1)
        self.beam_size = beam_size
        self._lock = threading.Lock()  # one pass at a time (the model is not reentrant)

    def words(self, samples_16k: np.ndarray) -> list[str]:
        """The words of one pass over `samples_16k` (float32 in [-1, 1] at 16 kHz)."""
        if len(samples_16k) < WHISPER_RATE_HZ // 10:  # under 0.1 s: nothing to hear
            return []
        with self._lock:
            segments, _ = self.model.transcribe(
                samples_16k, language="en", beam_size=self.beam_size, vad_filter=False,
                condition_on_previous_text=False, without_timestamps=True)
            text = "".join(segment.text for segment in segments)
        return text.split()


@dataclass
class StreamingTranscript:
    """One session's transcript, turn by turn, on the encoder thread."""

    whisper: Whisper
    sample_rate_hz: int
    committed: list[str] = field(default_factory=list)  # this turn's, final
    passes: int = 0  # Whisper passes run (the rest were shed or not needed)
    _previous: list[str] = field(default_factory=list)  # the last pass's words
    _audio: list[np.ndarray] = field(default_factory=list)  # this turn's, at 16 kHz
    _resampler: StreamingResampler | None = None
    _previous_end_ms: float | None = None  # where the last pass's audio ended

    def __post_init__(self) -> None:
        if self.sample_rate_hz != WHISPER_RATE_HZ:
            self._resampler = StreamingResampler(self.sample_rate_hz, WHISPER_RATE_HZ)

    def push(self, samples: np.ndarray, end_ms: float, final: bool,
             speech_from_ms: float | None = 0.0, pass_now: bool = True,
             speech_end_ms: float | None = None) -> list[str]:
        """This turn's audio continues with `samples` (float32 at the session's rate), which
        end at `end_ms` of the input stream; the words committed by it: agreed by two passes,
        or, `final` (the turn ended), all the rest (the next turn starts afresh).
        `speech_from_ms`: where the turn's speech starts (earlier audio is dropped); None: no
        speech yet (only the last `ROLLING_S` are kept, for the speech that may start in
        them). `pass_now` False: only keep the audio. `speech_end_ms` (a final push, where
        server VAD placed the end of speech): if the last pass already heard past it, that
        pass's words are the turn's and no new pass runs (it would hear the same speech; the
        turn's reply starts one pass sooner)."""
        if self._resampler is not None:
            samples = self._resampler.push(samples)
        self._audio.append(samples.astype(np.float32, copy=False))
        audio = np.concatenate(self._audio)
        start_ms = end_ms - len(audio) * 1000 / WHISPER_RATE_HZ
        keep_from_ms = end_ms - ROLLING_S * 1000 if speech_from_ms is None else speech_from_ms
        if keep_from_ms > start_ms:
            audio = audio[int((keep_from_ms - start_ms) * WHISPER_RATE_HZ / 1000):]
        self._audio = [audio]
        if not final and (speech_from_ms is None or not pass_now):
            return []
        done = len(self.committed)
        heard_the_end = (final and speech_end_ms is not None and self._previous_end_ms is not None
                         and self._previous_end_ms >= speech_end_ms + HEARD_THE_END_MS
                         and len(self._previous) >= done)
        if heard_the_end:
            words = self._previous
        else:
            words = self.whisper.words(audio[-int(WHISPER_MAX_S * WHISPER_RATE_HZ):])
            self._previous_end_ms = end_ms
            self.passes += 1
        if final:
            new = words[done:]  # committed words stand, even where this pass revised them
            self.committed, self._previous, self._audio = [], [], []
            self._previous_end_ms = None
            return new
        agreed = _common_prefix(words, self._previous)
        self._previous = words
        if len(agreed) <= done or [normalise_word(w) for w in agreed[:done]] != [
                normalise_word(w) for w in self.committed]:
            return []
        new = agreed[done:]
        self.committed += new
        return new


def _common_prefix(a: list[str], b: list[str]) -> list[str]:
    n = 0
    while n < min(len(a), len(b)) and normalise_word(a[n]) == normalise_word(b[n]):
        n += 1
    return a[:n]


def normalise_word(word: str) -> str:
    """A word as transcripts are compared: lower case, letters and digits only."""
    return "".join(ch for ch in word.lower() if ch.isalnum())
