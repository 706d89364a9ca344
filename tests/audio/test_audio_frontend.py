"""Audio front end: token counts, streaming == whole, feature sanity, PCM16, scale."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.audio import (
    AudioFormat,
    AudioFrontEnd,
    StreamingAudioEncoder,
    decode_pcm16,
    encode_pcm16,
    pcm16_frame_bytes,
)
from metronome.audio.mel import mel_center_frequencies_hz

HIDDEN = 64
EMBED_RMS = 0.05
FMT_24K = AudioFormat()  # 24 kHz, 12.5 Hz: 1920 samples = 8 hops per token
FRONTEND_24K = AudioFrontEnd(FMT_24K, HIDDEN, EMBED_RMS, seed=0)


def sweep_plus_noise(sample_rate_hz: int, duration_s: float, seed: int = 0) -> torch.Tensor:
    """A 100 Hz -> 6 kHz linear sine sweep plus white noise: (n,) float32."""
    t = torch.arange(round(sample_rate_hz * duration_s), dtype=torch.float64) / sample_rate_hz
    f0_hz, f1_hz = 100.0, 6000.0
    phase = 2 * math.pi * (f0_hz * t + (f1_hz - f0_hz) * t**2 / (2 * duration_s))
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(t.numel(), generator=generator, dtype=torch.float64)
    return (0.5 * torch.sin(phase) + 0.05 * noise).float()


SIGNAL_24K = sweep_plus_noise(24000, 0.5)  # 6 whole tokens + 480 pending samples
WHOLE_24K = FRONTEND_24K.encode(SIGNAL_24K)


def assert_same_embeddings(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # Equal up to float32 rounding: BLAS may sum a 1-row and an n-row matmul differently.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * EMBED_RMS)


@pytest.mark.parametrize(
    ("sample_rate_hz", "token_rate_hz", "samples_per_token", "hops_per_token"),
    [(16000, 12.5, 1280, 8), (24000, 12.5, 1920, 8), (16000, 25.0, 640, 4), (24000, 25.0, 960, 4)],
)
def test_token_counts_and_shapes(sample_rate_hz, token_rate_hz, samples_per_token, hops_per_token):
    fmt = AudioFormat(sample_rate_hz=sample_rate_hz, token_rate_hz=token_rate_hz)
    assert (fmt.samples_per_token, fmt.hops_per_token) == (samples_per_token, hops_per_token)
    assert fmt.bytes_per_token == 2 * samples_per_token
    frontend = AudioFrontEnd(fmt, HIDDEN, EMBED_RMS)
    signal = sweep_plus_noise(sample_rate_hz, 1.03)  # 1.03 s: a partial token at the end
    embeddings = frontend.encode(signal)
    assert embeddings.shape == (int(1.03 * token_rate_hz), HIDDEN)
    assert embeddings.dtype == torch.float32
    assert frontend.log_mel(signal).shape == (103, fmt.num_mels)


def test_frame_bytes():
    assert pcm16_frame_bytes(24000, 0.08) == 3840
    assert pcm16_frame_bytes(16000, 0.04) == 1280
    assert FMT_24K.frame_bytes(0.02) == 960
    with pytest.raises(ValueError, match="whole number of samples"):
        pcm16_frame_bytes(22050, 0.01)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sample_rate_hz": 16000.0}, "sample_rate_hz must be a positive int"),
        ({"sample_rate_hz": 0}, "sample_rate_hz must be a positive int"),
        ({"token_rate_hz": 0.0}, "token_rate_hz must be positive"),
        ({"sample_rate_hz": 22050}, r"hop \(10.0 ms at 22050 Hz\) in samples"),
        ({"token_rate_hz": 30.0}, r"token period \(33.3333 ms\) in hops"),
        ({"hop_ms": 30.0}, "hop_ms <= window_ms"),
        ({"num_mels": 0}, "num_mels must be a positive int"),
        ({"f_max_hz": 13000.0}, "Nyquist"),
    ],
)
def test_format_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AudioFormat(**kwargs)


def test_too_many_mels_for_the_window_is_refused():
    with pytest.raises(ValueError, match="too narrow"):
        AudioFrontEnd(AudioFormat(num_mels=300), HIDDEN, EMBED_RMS)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(cuts=st.lists(st.integers(0, SIGNAL_24K.numel()), max_size=12))
def test_streaming_equals_whole_for_any_chunking(cuts):
    bounds = [0, *sorted(cuts), SIGNAL_24K.numel()]
    stream = StreamingAudioEncoder(FRONTEND_24K)
    outputs = []
    for start, end in pairwise(bounds):
        outputs.append(stream.push(SIGNAL_24K[start:end]))
        assert 0 <= stream.pending_samples < FMT_24K.samples_per_token  # bounded memory
        assert stream._buffer.numel() < FMT_24K.samples_per_token + FMT_24K.window_samples
    assert_same_embeddings(torch.cat(outputs), WHOLE_24K)
    assert stream.pending_samples == SIGNAL_24K.numel() % FMT_24K.samples_per_token


def test_streaming_bytes_with_chunks_that_split_samples():
    data = encode_pcm16(SIGNAL_24K)
    stream = StreamingAudioEncoder(FRONTEND_24K)
    outputs = [stream.push(data[i : i + 1001]) for i in range(0, len(data), 1001)]  # odd sizes
    expected = FRONTEND_24K.encode(decode_pcm16(data))
    assert_same_embeddings(torch.cat(outputs), expected)
    stream.push(data[:1])
    with pytest.raises(ValueError, match="half a PCM16 sample"):
        stream.push(SIGNAL_24K[:10])


def test_one_token_per_token_period_push_and_reset():
    stream = StreamingAudioEncoder(FRONTEND_24K)
    spt = FMT_24K.samples_per_token
    assert stream.push(SIGNAL_24K[: spt - 1]).shape == (0, HIDDEN)
    assert stream.pending_samples == spt - 1
    assert stream.push(SIGNAL_24K[spt - 1 : spt]).shape == (1, HIDDEN)
    stream.reset()
    assert stream.pending_samples == 0
    assert_same_embeddings(stream.push(SIGNAL_24K[: 2 * spt]), WHOLE_24K[:2])


@pytest.mark.parametrize("tone_hz", [440.0, 3000.0])
def test_sine_lights_up_the_mel_bin_at_its_frequency(tone_hz):
    fmt = AudioFormat(sample_rate_hz=16000, token_rate_hz=25.0)
    tone = 0.5 * torch.sin(2 * math.pi * tone_hz * torch.arange(16000) / 16000)
    log_mel = AudioFrontEnd(fmt, HIDDEN, EMBED_RMS).log_mel(tone)
    loudest_bin = int(log_mel[5:].mean(0).argmax())  # skip frames that see the silent start
    centers_hz = mel_center_frequencies_hz(fmt.num_mels, 0.0, 8000.0)
    expected_bin = int((centers_hz - tone_hz).abs().argmin())
    assert abs(loudest_bin - expected_bin) <= 1, (loudest_bin, expected_bin)
    # Far from the tone is more than 30 dB down.
    assert log_mel[5:, loudest_bin].mean() - log_mel[5:, -1].mean() > 3.0


def test_pcm16_round_trip_and_scale():
    ints = torch.randint(-32768, 32768, (1000,), generator=torch.Generator().manual_seed(3))
    data = ints.to(torch.int16).numpy().astype("<i2").tobytes()
    samples = decode_pcm16(data)
    assert samples.dtype == torch.float32 and samples.shape == (1000,)
    assert samples.min() >= -1.0 and samples.max() < 1.0
    assert encode_pcm16(samples) == data
    assert decode_pcm16(b"\x00\x80\xff\x7f\x00\x00").tolist() == [-1.0, 32767 / 32768, 0.0]
    assert decode_pcm16(b"").shape == (0,)


def test_pcm16_odd_length_is_refused():
    with pytest.raises(ValueError, match="even number of bytes"):
        decode_pcm16(b"\x00\x01\x02")


def test_deterministic_per_seed():
    again = AudioFrontEnd(FMT_24K, HIDDEN, EMBED_RMS, seed=0).encode(SIGNAL_24K)
    assert torch.equal(again, WHOLE_24K)
    other_seed = AudioFrontEnd(FMT_24K, HIDDEN, EMBED_RMS, seed=1).encode(SIGNAL_24K)
    assert not torch.allclose(other_seed, WHOLE_24K)


def test_embedding_rms_matches_the_model_embeddings():
    embed_tokens = 0.02 * torch.randn(96, HIDDEN, generator=torch.Generator().manual_seed(7))
    embed_tokens = embed_tokens.to(torch.bfloat16)
    frontend = AudioFrontEnd.for_model(embed_tokens, FMT_24K)
    target_rms = embed_tokens.float().pow(2).mean().sqrt()
    for signal in (SIGNAL_24K, torch.zeros(4000), 1e-4 * SIGNAL_24K):  # loud, silent, quiet
        embeddings = frontend.encode(signal)
        assert embeddings.dtype == torch.bfloat16 and embeddings.shape[1] == HIDDEN
        token_rms = embeddings.float().pow(2).mean(-1).sqrt()
        assert torch.all((token_rms / target_rms - 1).abs() < 0.05), token_rms
