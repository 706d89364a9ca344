"""Server VAD's parts: the turn rules (exact, on made-up probabilities), the zero-phase
streaming resampler (chunking-invariant, on time), the Silero network (loaded from the
silero-vad wheel without importing the package: torch's thread count stays) and the whole
stream on the espeak-ng fixtures, against an energy gate's speech boundaries."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from metronome.audio.resample import StreamingResampler
from metronome.audio.silero import CHUNK_SAMPLES, SileroState, SileroVad, model_path
from metronome.audio.turn_detector import (
    SpeechPaused,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
)
from metronome.audio.vad import CHUNK_MS, VadStream
from metronome.load.speech import SENTENCES, speech_spans_ms, to_pcm16, utterances

BOUNDARY_TOLERANCE_MS = 100.0
PAUSES_S = [0.7, 1.2, 1.0]  # silence, speech, silence, speech, silence


def run_rules(detector: TurnDetector, probabilities: list[float], chunk_ms: float = 10.0):
    events = []
    for i, probability in enumerate(probabilities):
        event = detector.push(probability, i * chunk_ms, (i + 1) * chunk_ms)
        if event is not None:
            events.append((i, event))
    return events


# ---- the turn rules -------------------------------------------------------------------------
def test_speech_past_the_turn_limit_stops_there_and_goes_on_as_a_new_turn():
    """10 ms chunks, a 50 ms limit: speech that never pauses stops at the limit (the turn is
    answered there), starts again on its next chunk as speech that continues (no barge-in),
    and stops at the limit again; a real silence after it is an ordinary stop."""
    detector = TurnDetector(0.5, silence_duration_ms=30.0, max_turn_ms=50.0)
    events = run_rules(detector, [0.9] * 12 + [0.0] * 4 + [0.9])
    assert events == [
        (0, SpeechStarted(0.0)),
        (4, SpeechStopped(0.0, 50.0, at_limit=True)),
        (5, SpeechStarted(50.0, continues=True)),
        (9, SpeechStopped(50.0, 100.0, at_limit=True, continued=True)),
        (10, SpeechStarted(100.0, continues=True)),
        (14, SpeechStopped(100.0, 120.0, continued=True)),
        (16, SpeechStarted(160.0)),  # after a silence: a new turn, which may barge in
    ]
    # speech that ends right at the limit: what comes after a chunk of silence is new speech
    pause = run_rules(TurnDetector(0.5, 30.0, max_turn_ms=50.0), [0.9] * 5 + [0.0] + [0.9])
    assert pause == [(0, SpeechStarted(0.0)), (4, SpeechStopped(0.0, 50.0, at_limit=True)),
                     (6, SpeechStarted(60.0))]
    with pytest.raises(ValueError, match="max_turn_ms must be > 0"):
        TurnDetector(0.5, 30.0, max_turn_ms=0.0)


def test_speech_starts_at_the_first_chunk_over_the_threshold_and_stops_after_the_silence():
    # chunks of 10 ms; speech in chunks 2..4; silence of 30 ms confirms the stop
    events = run_rules(TurnDetector(0.5, silence_duration_ms=30),
                       [0.1, 0.2, 0.9, 0.6, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert events == [(2, SpeechStarted(20.0)), (7, SpeechStopped(20.0, 50.0))]


def test_undecided_chunks_neither_extend_speech_nor_end_it():
    # 0.4 is between the stop threshold (0.35) and the threshold: the stop waits for a chunk
    # under 0.35, but is placed where speech (>= 0.5) last ended
    events = run_rules(TurnDetector(0.5, silence_duration_ms=20),
                       [0.9, 0.4, 0.4, 0.4, 0.4, 0.1])
    assert events == [(0, SpeechStarted(0.0)), (5, SpeechStopped(0.0, 10.0))]


def test_a_pause_shorter_than_the_silence_duration_is_one_turn():
    events = run_rules(TurnDetector(0.5, silence_duration_ms=40),
                       [0.9, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0])
    assert events == [(0, SpeechStarted(0.0)), (8, SpeechStopped(0.0, 50.0))]


def test_a_pause_is_told_once_per_silence_before_the_stop_and_only_if_shorter():
    # speech in chunks 1..2, 20 ms of silence (a pause: told once), speech again in 5, then
    # the pause and, at 40 ms of silence, the stop
    probabilities = [0.0, 0.9, 0.9, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0]
    events = run_rules(TurnDetector(0.5, silence_duration_ms=40, pause_ms=20), probabilities)
    assert events == [(1, SpeechStarted(10.0)), (4, SpeechPaused(10.0, 30.0)),
                      (7, SpeechPaused(10.0, 60.0)), (9, SpeechStopped(10.0, 60.0))]
    # no pause as long as the silence that ends a turn, and none asked for
    for pause_ms in (40, None):
        events = run_rules(TurnDetector(0.5, silence_duration_ms=40, pause_ms=pause_ms),
                           probabilities)
        assert not any(isinstance(e, SpeechPaused) for _, e in events), events


def test_zero_silence_stops_at_the_first_silent_chunk_and_a_low_threshold_can_stop():
    assert run_rules(TurnDetector(0.5, 0), [0.9, 0.2]) == [
        (0, SpeechStarted(0.0)), (1, SpeechStopped(0.0, 10.0))]
    low = TurnDetector(0.1, 0)
    assert low.stop_threshold == pytest.approx(0.05)  # half the threshold, not 0.1 - 0.15
    assert [type(e) for _, e in run_rules(low, [0.2, 0.01])] == [SpeechStarted, SpeechStopped]


@pytest.mark.parametrize("threshold, silence_ms", [(-0.1, 100), (1.5, 100), (0.5, -1)])
def test_bad_rules_are_refused(threshold, silence_ms):
    with pytest.raises(ValueError):
        TurnDetector(threshold, silence_ms)


# ---- the resampler --------------------------------------------------------------------------
@pytest.mark.parametrize("from_hz", [24000, 48000, 8000])
def test_resampling_in_any_chunking_equals_resampling_at_once_and_keeps_time(from_hz):
    t_s = np.arange(from_hz) / from_hz
    tone = np.sin(2 * np.pi * 440 * t_s).astype(np.float32)
    whole = StreamingResampler(from_hz, 16000).push(tone)
    streamed, rng, resampler, i = [], np.random.default_rng(0), StreamingResampler(from_hz,
                                                                                  16000), 0
    while i < len(tone):
        n = int(rng.integers(1, 900))
        streamed.append(resampler.push(tone[i:i + n]))
        i += n
    assert np.array_equal(np.concatenate(streamed), whole)
    assert 16000 - len(whole) <= 32  # held back: the kernel's half-width (about 1 ms)
    expected = np.sin(2 * np.pi * 440 * np.arange(len(whole)) / 16000)  # zero phase
    assert np.abs(whole[320:] - expected[320:]).max() < 1e-3  # after the start's edge


def test_resampling_down_removes_what_16_khz_cannot_hold():
    tone = np.sin(2 * np.pi * 10000 * np.arange(48000) / 48000).astype(np.float32)
    out = StreamingResampler(48000, 16000).push(tone)[320:]
    assert np.sqrt(np.mean(out ** 2)) < 0.01  # a 10 kHz tone would alias to 6 kHz


# ---- the network ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def silero():
    threads = torch.get_num_threads()
    model = SileroVad()
    assert torch.get_num_threads() == threads  # the package's import would have set 1
    return model


def test_the_model_file_comes_from_the_wheel_and_the_package_is_never_imported(silero):
    assert model_path().parts[-3:] == ("silero_vad", "data", "silero_vad.onnx")
    assert "silero_vad" not in sys.modules


def test_silence_is_not_speech_and_speech_is(silero):
    state = SileroState()
    silence = [silero.speech_probability(state, np.zeros(CHUNK_SAMPLES, np.float32))
               for _ in range(10)]
    speech = utterances(["weather"], 16000, [0.0, 0.0])
    state = SileroState()
    voiced = [silero.speech_probability(state, chunk) for chunk in
              speech[: len(speech) // CHUNK_SAMPLES * CHUNK_SAMPLES].reshape(-1, CHUNK_SAMPLES)]
    assert max(silence) < 0.05
    assert np.median(voiced) > 0.9


# ---- the stream, on the fixtures -------------------------------------------------------------
def stream_turns(silero: SileroVad, samples: np.ndarray, rate_hz: int, chunk_ms: float):
    stream, pcm = VadStream(rate_hz, threshold=0.5, silence_duration_ms=500), to_pcm16(samples)
    step = round(rate_hz * chunk_ms / 1000) * 2
    return [e for i in range(0, len(pcm), step) for e in stream.push(silero, pcm[i:i + step])]


@pytest.mark.parametrize("rate_hz", [16000, 24000, 48000])
@pytest.mark.parametrize("name", sorted(SENTENCES))
def test_speech_boundaries_are_within_100_ms_of_the_energy_gate(silero, name, rate_hz):
    samples = utterances([name, name], rate_hz, PAUSES_S)
    truth = speech_spans_ms(samples, rate_hz)
    assert len(truth) == 2 and truth[0][0] == pytest.approx(700, abs=20)
    events = stream_turns(silero, samples, rate_hz, chunk_ms=20)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped] * 2
    found = [(events[k].start_ms, events[k + 1].end_ms) for k in (0, 2)]
    for (start_ms, end_ms), (true_start_ms, true_end_ms) in zip(found, truth, strict=True):
        assert abs(start_ms - true_start_ms) <= BOUNDARY_TOLERANCE_MS, (found, truth)
        assert abs(end_ms - true_end_ms) <= BOUNDARY_TOLERANCE_MS, (found, truth)
    assert events[1] == SpeechStopped(events[0].start_ms, events[1].end_ms)
    assert all(e.start_ms % CHUNK_MS == 0 for e in events)  # on the 32 ms chunk grid


def test_the_turns_do_not_depend_on_how_the_audio_is_chunked(silero):
    samples = utterances(["booking"], 24000, [0.5, 0.8])
    assert stream_turns(silero, samples, 24000, chunk_ms=7) == stream_turns(
        silero, samples, 24000, chunk_ms=250)


def test_a_stream_begun_mid_session_reports_session_positions(silero):
    samples = utterances(["station"], 16000, [0.5, 0.8])
    stream = VadStream(16000, 0.5, 500, origin_ms=10_000.0)
    events = stream.push(silero, to_pcm16(samples))
    baseline = stream_turns(silero, samples, 16000, chunk_ms=len(samples) / 16)
    assert [e.start_ms - 10_000 for e in events] == [e.start_ms for e in baseline]
