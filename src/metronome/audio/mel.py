"""Log-mel features: a Slaney mel filterbank built here, and causal STFT framing.

Mel scale: Slaney (Auditory Toolbox; librosa's and Whisper's default): linear below 1 kHz
(3 mel per 200 Hz), logarithmic above; each triangle is area-normalised ("slaney" norm), so
a filter's response does not grow with its bandwidth.

Framing is causal so that it can stream: frame `t` covers the `window` samples that end at
sample `(t + 1) * hop`. The caller supplies `window - hop` samples of left context (zeros at
the start of a stream), so each whole hop of new audio completes exactly one frame, and a
frame never waits for audio after its own hop.
"""

from __future__ import annotations

import math

import torch

# Slaney's break between the linear and the log part of the scale.
_LINEAR_HZ_PER_MEL = 200.0 / 3.0
_BREAK_HZ = 1000.0
_BREAK_MEL = _BREAK_HZ / _LINEAR_HZ_PER_MEL  # 15 mel
_LOG_STEP = math.log(6.4) / 27.0  # 27 mel per factor 6.4 above 1 kHz
_POWER_FLOOR = 1e-10  # log10 floor: digital silence is -10, not -inf


def hz_to_mel(freq_hz: torch.Tensor) -> torch.Tensor:
    linear = freq_hz / _LINEAR_HZ_PER_MEL
    log_part = _BREAK_MEL + torch.log(freq_hz.clamp_min(_BREAK_HZ) / _BREAK_HZ) / _LOG_STEP
    return torch.where(freq_hz < _BREAK_HZ, linear, log_part)


def mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    linear = mel * _LINEAR_HZ_PER_MEL
    log_part = _BREAK_HZ * torch.exp(_LOG_STEP * (mel - _BREAK_MEL))
    return torch.where(mel < _BREAK_MEL, linear, log_part)


def mel_center_frequencies_hz(num_mels: int, f_min_hz: float, f_max_hz: float) -> torch.Tensor:
    """Centre of each filter, low to high: (num_mels,)."""
    return _mel_edges_hz(num_mels, f_min_hz, f_max_hz)[1:-1]


def _mel_edges_hz(num_mels: int, f_min_hz: float, f_max_hz: float) -> torch.Tensor:
    bounds_mel = hz_to_mel(torch.tensor([f_min_hz, f_max_hz], dtype=torch.float64))
    mel = torch.linspace(bounds_mel[0], bounds_mel[1], num_mels + 2, dtype=torch.float64)
    return mel_to_hz(mel)


def mel_filterbank(
    sample_rate_hz: int, n_fft: int, num_mels: int, f_min_hz: float, f_max_hz: float
) -> torch.Tensor:
    """Triangular Slaney filters over the rfft bins: (n_fft // 2 + 1, num_mels), float32."""
    bin_hz = torch.arange(n_fft // 2 + 1, dtype=torch.float64) * sample_rate_hz / n_fft
    edges_hz = _mel_edges_hz(num_mels, f_min_hz, f_max_hz)  # (num_mels + 2,)
    lower, center, upper = edges_hz[:-2], edges_hz[1:-1], edges_hz[2:]
    rising = (bin_hz[:, None] - lower) / (center - lower)  # (n_freq, num_mels)
    falling = (upper - bin_hz[:, None]) / (upper - center)
    weights = torch.minimum(rising, falling).clamp_min(0.0) * (2.0 / (upper - lower))
    num_empty = int((weights.sum(0) == 0).sum())
    if num_empty:
        raise ValueError(
            f"{num_mels} mel filters are too narrow for a {n_fft}-point FFT at "
            f"{sample_rate_hz} Hz: {num_empty} of them cover no FFT bin; use fewer mels or "
            "a longer window"
        )
    return weights.float()


def causal_log_mel(
    padded: torch.Tensor, hop_samples: int, window: torch.Tensor, filterbank: torch.Tensor
) -> torch.Tensor:
    """log10 mel power of causal frames: (num_frames, num_mels).

    `padded` is `window - hop` samples of left context followed by whole hops of audio;
    num_frames = (len(padded) - window + hop) // hop. The FFT size is the window length
    (as in Whisper: 400 points = 25 ms at 16 kHz).
    """
    window_samples = window.numel()
    spectrum = torch.stft(
        padded, n_fft=window_samples, hop_length=hop_samples, window=window,
        center=False, return_complex=True,
    )  # (n_freq, num_frames)
    power = spectrum.abs().pow(2).T  # (num_frames, n_freq)
    return torch.log10((power @ filterbank).clamp_min(_POWER_FLOOR))
