"""Hearing: Whisper tiny.en (CTranslate2, int8) and a streaming transcript over its passes.

`Whisper` is the model: 16 kHz float samples in, words out, one pass. A pass hears a window of
max(clip, `window_s`) seconds (10 s by default), not the 30 s faster-whisper's `transcribe()`
always pads to: its encoder cost follows the window (on 2 cores ~5x less at 10 s than at 30 s;
`metronome bench ear`). CTranslate2 takes fewer than 3,000 mel frames (its PR #1446), so the
pass calls the model's `encode` and `generate` itself; the guards `transcribe()` gave are kept
here: the tokens capped by the clip's duration, a phrase repeated in a loop cut to once (below
~6-8 s tiny.en loops: "Yes. Yes. Yes."), and no words where the model says there is no speech.
`window_s=None` is `transcribe()` itself: the 30 s reference the window is measured against.
It runs on the server's encoder thread, never on the loop or the engine's thread.

`StreamingTranscript` is one turn's transcript as its audio arrives (LocalAgreement-2, as
streaming-Whisper servers do): each pass transcribes the turn's audio so far; the words two
consecutive passes agree on, past what is committed, are committed, and never change again.
So when the user stops, most of the turn's words are already in the session's KV; the
final pass commits the rest. A pass that would only repeat one already queued behind it is
skipped (`push(..., pass_now=False)`): under load the transcript commits less often, it never
falls further behind than one pass.

A turn of any length costs the same per second: once the audio not settled yet (the turn's
*segment*) is longer than `SEGMENT_MAX_S`, it is cut at its quietest moment (`quietest_cut`:
the lowest energy over 30 ms, a word boundary or a stop's closure in continuous speech) at
least `CUT_KEEP_S` before its end; the part before the cut is heard to its end by one pass,
as a turn's end is (its words committed, those two passes agreed on standing), and never heard
again; the segment goes on from the cut (with any agreed words that lay past the cut as its
first, committed already: the passes hear no word times, so they are counted off). So no
pass hears more than `SEGMENT_MAX_S` plus a frame (within the 10 s window: a pass's cost does
not grow with the turn), and a turn's words keep arriving however long it runs. A cut is not
speculative: it runs even when partial passes are shed, so a stage that is behind never lets
a segment grow.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import numpy as np

from metronome.audio.carriers import whisper_model_dir
from metronome.audio.resample import StreamingResampler

WHISPER_RATE_HZ = 16000
WHISPER_MAX_S = 30.0  # one pass hears at most this much: a longer turn keeps its last 30 s
ROLLING_S = 3.0  # audio kept before speech is detected (VAD reports a frame or so late)
HEARD_THE_END_MS = 150.0  # a pass that heard this far past the speech's end heard it all
SEGMENT_MAX_S = 8.0  # a turn's unsettled audio longer than this is cut and its head settled
CUT_KEEP_S = 2.0  # ... at least this much before its end (the words still being said) ...
CUT_FROM_S = 3.0  # ... and at least this far into it (a head long enough to hear well)
CUT_WINDOW_S = 0.03  # the energy window the quietest moment is found with


WINDOW_S = 10.0  # a pass hears max(clip, this): the smallest window measured to keep WER
# within 1.5 points of 30 s on every speech set (`metronome bench ear`); below ~6-8 s tiny.en
# loops on short clips
HOP_SAMPLES = 160  # one mel frame (10 ms at 16 kHz)
MAX_TOKENS_PER_S = 8  # the cap on a pass's tokens by the clip's duration (speech: ~3-5/s)
MIN_MAX_TOKENS = 16  # ... and at least this many, for the shortest clips
STEPS_PER_TOKEN = 2  # CTranslate2's Whisper `max_length` yields about half as many tokens
# (measured on tiny.en: max_length 21 -> 10 tokens, 31 -> 15; a 3.7 s sentence capped at
# 2 + 8/s lost its last word, "available")
MIN_LOOP_REPEATS = 3  # a phrase said this many times in a row is a loop: kept once
MAX_LOOP_WORDS = 8  # the longest phrase looked for
NO_SPEECH_PROB = 0.6  # transcribe()'s: no words where the model says this AND ...
LOW_AVG_LOGPROB = -1.0  # ... its tokens' mean log-probability is below this; or where ...
SURE_NO_SPEECH_PROB = 0.9  # ... it says this at all: on a short window of silence it says
# 0.99 and still writes "you" at a mean log-probability of -0.65 (speech: 0.006-0.04)


class Whisper:
    def __init__(self, cpu_threads: int = 1, beam_size: int = 1,
                 window_s: float | None = WINDOW_S) -> None:
        """`window_s`: the least a pass hears (seconds, at most 30); None: faster-whisper's
        `transcribe()`, which pads every pass to 30 s (the reference)."""
        from faster_whisper import WhisperModel  # imported here: ~0.3 s, only when hearing
        from faster_whisper.tokenizer import Tokenizer
        from faster_whisper.transcribe import get_suppressed_tokens

        if window_s is not None and not 1.0 <= window_s <= WHISPER_MAX_S:
            raise ValueError(f"a Whisper window is 1-{WHISPER_MAX_S:g} s, got {window_s}")
        self.model = WhisperModel(str(whisper_model_dir()), device="cpu", compute_type="int8",
                                  cpu_threads=cpu_threads, num_workers=1)
        self.beam_size = beam_size
        self.window_s = window_s
        self.tokenizer = Tokenizer(self.model.hf_tokenizer, False, task="transcribe",
                                   language="en")
        self.prompt = self.model.get_prompt(self.tokenizer, [], without_timestamps=True)
        self.suppress_tokens = list(get_suppressed_tokens(self.tokenizer, [-1]) or [])
        self._lock = threading.Lock()  # one pass at a time (the model is not reentrant)
        self.loops_cut = 0  # passes whose words the loop guard cut (`cut_loops`)

    def words(self, samples_16k: np.ndarray) -> list[str]:
        """The words of one pass over `samples_16k` (float32 in [-1, 1] at 16 kHz; its last
        30 s at most)."""
        if len(samples_16k) < WHISPER_RATE_HZ // 10:  # under 0.1 s: nothing to hear
            return []
        samples_16k = samples_16k[-int(WHISPER_MAX_S * WHISPER_RATE_HZ):]
        with self._lock:
            if self.window_s is None:
                return self._transcribe(samples_16k).split()
            words = self._windowed(samples_16k).split()
            kept = cut_loops(words)
            self.loops_cut += len(kept) < len(words)
            return kept

    def _transcribe(self, samples_16k: np.ndarray) -> str:
        segments, _ = self.model.transcribe(
            samples_16k, language="en", beam_size=self.beam_size, vad_filter=False,
            condition_on_previous_text=False, without_timestamps=True)
        return "".join(segment.text for segment in segments)

    def _windowed(self, samples_16k: np.ndarray) -> str:
        """One pass over a window of max(clip, window_s): the log-mel of the clip followed by
        silence (zero audio, as faster-whisper pads since its PR #1101), encoded and decoded
        greedily with the tokens capped by the clip's duration."""
        import ctranslate2

        assert self.window_s is not None
        clip_frames = len(samples_16k) // HOP_SAMPLES + 1
        frames = min(int(WHISPER_MAX_S * 100), max(clip_frames, int(self.window_s * 100)))
        padded = np.zeros((frames + 2) * HOP_SAMPLES, np.float32)
        padded[:len(samples_16k)] = samples_16k
        features = self.model.feature_extractor(padded)[:, :frames]
        encoded = self.model.model.encode(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(features[None])))
        clip_s = len(samples_16k) / WHISPER_RATE_HZ
        max_tokens = max(MIN_MAX_TOKENS, int(MAX_TOKENS_PER_S * clip_s))
        result = self.model.model.generate(
            encoded, [self.prompt], beam_size=self.beam_size,
            max_length=min(self.model.max_length,
                           len(self.prompt) + STEPS_PER_TOKEN * max_tokens),
            return_scores=True, return_no_speech_prob=True, suppress_blank=True,
            suppress_tokens=self.suppress_tokens)[0]
        tokens = [t for t in result.sequences_ids[0] if t < self.tokenizer.eot]
        avg_logprob = result.scores[0] * len(tokens) / (len(tokens) + 1)  # as transcribe()
        no_speech = result.no_speech_prob
        if no_speech > SURE_NO_SPEECH_PROB or (no_speech > NO_SPEECH_PROB
                                               and avg_logprob < LOW_AVG_LOGPROB):
            return ""
        return self.tokenizer.decode(tokens)


def cut_loops(words: list[str]) -> list[str]:
    """`words` with any phrase (1 to MAX_LOOP_WORDS words) said MIN_LOOP_REPEATS or more times
    in a row kept once: what Whisper emits when it loops on a short or silent window ("Yes.
    Yes. Yes. ..."). Speech repeats a phrase twice at times ("no, no"); three times in a row
    on one clip is the model."""
    keys = [normalise_word(w) for w in words]
    out: list[str] = []
    i = 0
    while i < len(words):
        loop = _loop_at(keys, i)
        if loop is None:
            out.append(words[i])
            i += 1
        else:
            num_words, repeats = loop
            out += words[i:i + num_words]
            i += num_words * repeats
    return out


def _loop_at(keys: list[str], i: int) -> tuple[int, int] | None:
    """The shortest phrase starting at `i` repeated MIN_LOOP_REPEATS times or more in a row:
    (its words, its repeats), or None."""
    for n in range(1, MAX_LOOP_WORDS + 1):
        phrase = keys[i:i + n]
        if len(phrase) < n:
            return None
        repeats = 1
        while keys[i + repeats * n:i + (repeats + 1) * n] == phrase:
            repeats += 1
        if repeats >= MIN_LOOP_REPEATS:
            return n, repeats
    return None


@dataclass
class StreamingTranscript:
    """One session's transcript, turn by turn, on the encoder thread."""

    whisper: Whisper
    sample_rate_hz: int
    committed: list[str] = field(default_factory=list)  # this segment's, final
    passes: int = 0  # Whisper passes run (the rest were shed or not needed)
    cuts: int = 0  # segments settled inside a turn (`SEGMENT_MAX_S`)
    _previous: list[str] = field(default_factory=list)  # the last pass's words
    _audio: list[np.ndarray] = field(default_factory=list)  # this turn's, at 16 kHz
    _resampler: StreamingResampler | None = None
    _previous_end_ms: float | None = None  # where the last pass's audio ended
    _carried: int = 0  # the segment's first committed words, agreed before its cut: counted
    # off, not compared (heard again without what came before the cut, they may differ)

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
        keep_from_ms = end_ms - ROLLING_S * 1000 if speech_from_ms is None else speech_from_ms
        audio = _kept(self._audio, end_ms, keep_from_ms)
        self._audio = [audio]
        if not final and speech_from_ms is not None and len(audio) > (
                SEGMENT_MAX_S * WHISPER_RATE_HZ):
            return self._cut(audio)
        if not final and (speech_from_ms is None or not pass_now):
            return []
        done = len(self.committed)
        heard_the_end = (final and speech_end_ms is not None and self._previous_end_ms is not None
                         and self._previous_end_ms >= speech_end_ms + HEARD_THE_END_MS
                         and len(self._previous) >= done)
        if heard_the_end:
            words = self._previous
        else:
            words = self.whisper.words(audio)
            self._previous_end_ms = end_ms
            self.passes += 1
        if final:
            new = words[done:]  # committed words stand, even where this pass revised them
            self._next_segment([], [])
            return new
        agreed = _common_prefix(words, self._previous)
        self._previous = words
        carried = self._carried
        if len(agreed) <= done or [normalise_word(w) for w in agreed[carried:done]] != [
                normalise_word(w) for w in self.committed[carried:]]:
            return []
        new = agreed[done:]
        self.committed += new
        return new

    def _cut(self, audio: np.ndarray) -> list[str]:
        """Settle the segment's head: cut `audio` (the segment) at its quietest moment, hear
        the head to its end (its words past those committed are committed: the head is done,
        as a turn's end is) and go on with the rest as the segment."""
        cut = quietest_cut(audio)
        words = self.whisper.words(audio[:cut])
        self.passes += 1
        self.cuts += 1
        done = len(self.committed)
        new = words[done:]
        # words two passes agreed on may lie past the cut: they stand, as the next segment's
        # first (its passes hear them again and commit only what follows)
        self._next_segment(self.committed[len(words):], [audio[cut:]])
        return new

    def _next_segment(self, carried: list[str], audio: list[np.ndarray]) -> None:
        """A new segment begins (after a cut, or the next turn's): `audio` so far, `carried`
        its words committed already."""
        self.committed, self._carried, self._audio = carried, len(carried), audio
        self._previous, self._previous_end_ms = [], None

    def hear_ahead(self, samples: np.ndarray, end_ms: float, speech_from_ms: float) -> None:
        """A pass over this turn's audio followed by `samples` (the audio since, not pushed
        yet: the turn's next push brings it), which end at `end_ms`: server VAD heard a
        pause in the speech. Its words become the last pass's and nothing is committed; if
        the pause becomes the turn's end (the final push's `speech_end_ms` before `end_ms`),
        they are the turn's and the final push runs no pass: the turn's last pass ran
        during the silence that confirmed it, not after. If the user speaks on, it was one
        pass more (the next pass agrees with it or not, as with any)."""
        if self._resampler is not None:  # a copy: the next push resamples these samples
            samples = copy.deepcopy(self._resampler).push(samples)
        audio = _kept([*self._audio, samples.astype(np.float32, copy=False)], end_ms,
                      speech_from_ms)
        self._previous = self.whisper.words(audio)
        self._previous_end_ms = end_ms
        self.passes += 1


def quietest_cut(audio: np.ndarray) -> int:
    """The sample to cut 16 kHz speech at: the middle of its quietest `CUT_WINDOW_S` (mean
    square energy) between `CUT_FROM_S` from its start and `CUT_KEEP_S` before its end."""
    window = int(CUT_WINDOW_S * WHISPER_RATE_HZ)
    first = int(CUT_FROM_S * WHISPER_RATE_HZ)
    last = len(audio) - int(CUT_KEEP_S * WHISPER_RATE_HZ)
    assert last - first >= window, f"{len(audio)} samples are too few to cut"
    running = np.concatenate(([0.0], np.cumsum(np.square(audio[first:last], dtype=np.float64))))
    energy = running[window:] - running[:-window]  # each window's, from each start
    return first + int(np.argmin(energy)) + window // 2


def _kept(pieces: list[np.ndarray], end_ms: float, keep_from_ms: float) -> np.ndarray:
    """16 kHz audio in pieces that end at `end_ms` of the stream, as one array from
    `keep_from_ms` on (all of it if it starts later)."""
    audio = np.concatenate(pieces)
    start_ms = end_ms - len(audio) * 1000 / WHISPER_RATE_HZ
    if keep_from_ms > start_ms:
        audio = audio[int((keep_from_ms - start_ms) * WHISPER_RATE_HZ / 1000):]
    return audio


def _common_prefix(a: list[str], b: list[str]) -> list[str]:
    n = 0
    while n < min(len(a), len(b)) and normalise_word(a[n]) == normalise_word(b[n]):
        n += 1
    return a[:n]


def normalise_word(word: str) -> str:
    """A word as transcripts are compared: lower case, letters and digits only."""
    return "".join(ch for ch in word.lower() if ch.isalnum())
