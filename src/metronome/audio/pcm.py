"""PCM16 wire format: little-endian signed 16-bit mono samples <-> float32 in [-1, 1).

This is the OpenAI Realtime `pcm16` input format. One scale (32768) both ways, so
`encode_pcm16(decode_pcm16(data)) == data` exactly.
"""

from __future__ import annotations

import numpy as np
import torch

PCM16_BYTES_PER_SAMPLE = 2
_PCM16_SCALE = 32768.0


def decode_pcm16(data: bytes) -> torch.Tensor:
    """Little-endian int16 bytes -> float32 samples in [-1, 1): (len(data) // 2,)."""
    return torch.from_numpy(decode_pcm16_array(data))


def decode_pcm16_array(data: bytes) -> np.ndarray:
    """`decode_pcm16` as a NumPy array, for code that must not run torch (the VAD thread)."""
    if len(data) % PCM16_BYTES_PER_SAMPLE:
        raise ValueError(
            f"PCM16 audio must have an even number of bytes (2 per sample), got {len(data)}"
        )
    ints = np.frombuffer(data, dtype="<i2")
    return ints.astype(np.float32) / np.float32(_PCM16_SCALE)


def encode_pcm16(samples: torch.Tensor) -> bytes:
    """Float samples (n,) -> little-endian int16 bytes; values outside [-1, 1) are clipped."""
    scaled = torch.round(samples.detach().float().cpu() * _PCM16_SCALE)
    ints = scaled.clamp(-32768, 32767).to(torch.int16).numpy()
    return ints.astype("<i2").tobytes()


def pcm16_frame_bytes(sample_rate_hz: int, frame_period_s: float) -> int:
    """Bytes of PCM16 mono audio in one frame: 80 ms at 24 kHz -> 1920 samples -> 3840 bytes."""
    num_samples = sample_rate_hz * frame_period_s
    if frame_period_s <= 0 or abs(num_samples - round(num_samples)) > 1e-6:
        raise ValueError(
            f"a frame of {frame_period_s} s at {sample_rate_hz} Hz is not a positive whole "
            f"number of samples ({num_samples})"
        )
    return round(num_samples) * PCM16_BYTES_PER_SAMPLE
