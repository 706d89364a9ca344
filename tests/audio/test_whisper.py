"""The ear: a Whisper pass hears a window of max(clip, 10 s), not 30 s, and keeps the guards
faster-whisper's `transcribe()` gave (no words on silence, a looped phrase cut, tokens capped by
the clip's duration); it hears the served voice as the 30 s reference does, for less."""

from __future__ import annotations

import time

import numpy as np
import pytest

from metronome.audio.whisper import (
    MAX_TOKENS_PER_S,
    MIN_MAX_TOKENS,
    SEGMENT_MAX_S,
    WHISPER_RATE_HZ,
    WINDOW_S,
    StreamingTranscript,
    Whisper,
    cut_loops,
)


def test_a_phrase_said_three_times_or_more_in_a_row_is_kept_once():
    assert cut_loops("Yes. Yes. Yes. Yes.".split()) == ["Yes."]
    assert cut_loops("I think so, I think so. I think so and then".split()) == [
        "I", "think", "so,", "and", "then"]
    assert cut_loops("no, no thanks".split()) == ["no,", "no", "thanks"]  # twice: speech
    assert cut_loops("a b a b c".split()) == ["a", "b", "a", "b", "c"]
    assert cut_loops([]) == []


def test_a_window_outside_one_to_thirty_seconds_is_refused():
    with pytest.raises(ValueError, match="a Whisper window is 1-30 s, got 45"):
        Whisper(window_s=45)


@pytest.fixture(scope="module")
def speech() -> dict[str, np.ndarray]:
    from metronome.audio.voice import Voice

    voice = Voice()
    # spoken exactly (without Piper's sampled variation: the same audio every run). LONG, 3.7 s:
    # with the token cap read as CTranslate2's `max_length` itself its last word was lost
    return {text: np.frombuffer(voice.speak(text, WHISPER_RATE_HZ, exact=True), "<i2")
            .astype(np.float32) / 32768
            for text in ("Yes.", "What is the capital of France?",
                         "How far is the moon from the earth?", LONG)}


LONG = "I would like to change my flight to Thursday morning if there is a seat available."


@pytest.mark.model
def test_the_window_hears_what_thirty_seconds_hear_for_less(speech):
    windowed, reference = Whisper(window_s=WINDOW_S), Whisper(window_s=None)
    for whisper in (windowed, reference):  # their kernels set up
        whisper.words(np.zeros(WHISPER_RATE_HZ, np.float32))
    costs_s: dict[str, list[float]] = {"windowed": [], "reference": []}
    for text, samples in speech.items():
        for name, whisper in (("windowed", windowed), ("reference", reference)):
            started = time.process_time()
            words = whisper.words(samples)
            costs_s[name].append(time.process_time() - started)
            assert [w.strip(".?,").lower() for w in words] == [
                w.strip(".?,").lower() for w in text.split()], (name, words)
    # a 10 s window is a third of 30 s: measured ~3-5x less CPU time (the process's: the
    # passes run on CTranslate2's threads)
    assert sum(costs_s["windowed"]) < 0.6 * sum(costs_s["reference"]), costs_s


@pytest.mark.model
def test_silence_is_no_words_and_a_loop_is_cut():
    whisper = Whisper(window_s=WINDOW_S)
    # on a short window of silence tiny.en writes "you", though it says 0.99 no speech
    assert whisper.words(np.zeros(2 * WHISPER_RATE_HZ, np.float32)) == []
    assert whisper.words(np.zeros(WHISPER_RATE_HZ // 20, np.float32)) == []  # under 0.1 s


@pytest.mark.model
def test_a_window_too_short_for_the_model_loops_and_the_guard_cuts_it(speech):
    """Below ~6-8 s tiny.en loops on short clips ("Yes. Yes. Yes. ..."): the guard keeps
    one, and the tokens are capped by the clip's duration."""
    whisper = Whisper(window_s=1.0)
    clips = [samples for text, samples in speech.items() if text != LONG]
    passes = [whisper.words(samples) for samples in clips]
    assert whisper.loops_cut >= 1, passes
    for words, samples in zip(passes, clips, strict=True):
        assert cut_loops(words) == words
        # a word is one token or more: never more words than the clip's token cap
        assert len(words) <= max(MIN_MAX_TOKENS, MAX_TOKENS_PER_S * len(samples)
                                 / WHISPER_RATE_HZ), words


@pytest.mark.model
def test_a_pass_heard_ahead_at_a_pause_is_the_turns_last_when_the_pause_ends_it():
    """Server VAD hears a pause 200 ms into the silence: the turn's last pass runs then, on
    the frames pushed and the audio not cut into one yet (at 24 kHz: resampled by a copy of
    the transcript's resampler). The commit at the pause's end runs no pass and commits the
    same words as a turn heard without it."""
    from metronome.audio.voice import Voice

    rate_hz = 24000
    speech = np.frombuffer(Voice().speak(LONG, rate_hz, exact=True), "<i2").astype(
        np.float32) / 32768
    speech_end_ms = 1000 * len(speech) / rate_hz  # ~3.7 s: frames end at 1, 2, 3 s
    audio = np.concatenate([speech, np.zeros(rate_hz // 4, np.float32)])
    whisper = Whisper(window_s=WINDOW_S)
    heard, passes = {}, {}
    for ahead in (False, True):
        transcript = StreamingTranscript(whisper, rate_hz)
        words = []
        for end in range(rate_hz, len(audio), rate_hz):  # the 1 s frames
            words += transcript.push(audio[end - rate_hz:end], 1000 * end / rate_hz, False)
        rest_from = len(audio) // rate_hz * rate_hz
        end_ms = 1000 * len(audio) / rate_hz
        if ahead:
            transcript.hear_ahead(audio[rest_from:], end_ms, 0.0)
        before = transcript.passes
        words += transcript.push(audio[rest_from:], end_ms, True, speech_end_ms=speech_end_ms)
        heard[ahead], passes[ahead] = words, transcript.passes - before
    assert passes == {False: 1, True: 0}
    assert heard[True] == heard[False] and [w.strip(".").lower() for w in heard[True]] == [
        w.strip(".").lower() for w in LONG.split()], heard


@pytest.mark.model
def test_a_long_turn_is_heard_in_settled_segments_each_pass_bounded():
    """A 40 s turn without a pause (sentences 150 ms apart, under VAD's 500 ms), pushed in
    1 s frames: no pass hears more than `SEGMENT_MAX_S` and a frame (the 30 s reference
    re-heard the whole turn, and past 30 s lost its start), the turn is settled in segments
    cut at quiet moments, and its words are the text's within 10 % (Whisper tiny.en on the
    whole of each sentence alone: 0-5 %)."""
    from metronome.audio.voice import Voice
    from metronome.bench.presets.talkers import PARAGRAPH
    from metronome.bench.presets.voice import wer

    voice = Voice()
    breath = np.zeros(int(0.15 * WHISPER_RATE_HZ), np.float32)
    pieces, said = [], []
    while sum(len(p) for p in pieces) < 40 * WHISPER_RATE_HZ:
        sentence = PARAGRAPH[len(said)]
        pieces += [np.frombuffer(voice.speak(sentence, WHISPER_RATE_HZ, exact=True), "<i2")
                   .astype(np.float32) / 32768, breath]
        said.append(sentence)
    audio = np.concatenate(pieces)
    whisper = Whisper(window_s=WINDOW_S)
    heard_s: list[float] = []
    words_of = whisper.words

    def timed_words(samples: np.ndarray) -> list[str]:
        heard_s.append(len(samples) / WHISPER_RATE_HZ)
        return words_of(samples)

    whisper.words = timed_words  # type: ignore[method-assign]
    transcript = StreamingTranscript(whisper, WHISPER_RATE_HZ)
    words: list[str] = []
    frame = WHISPER_RATE_HZ
    for end in range(frame, len(audio) + frame, frame):
        piece = audio[end - frame:end]
        words += transcript.push(piece, 1000 * min(end, len(audio)) / WHISPER_RATE_HZ,
                                 end >= len(audio))
    assert max(heard_s) <= SEGMENT_MAX_S + 1.0, heard_s
    assert transcript.cuts >= 40 // SEGMENT_MAX_S, transcript.cuts
    assert wer(" ".join(said), " ".join(words)) <= 0.10, " ".join(words)
