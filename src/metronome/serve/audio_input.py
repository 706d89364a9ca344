"""One session's audio input: PCM16 bytes in any chunking -> frames of `frame_period_s`.

Owns the bytes of the frame being filled and the session's streaming encoder. A frame is
cut the moment its last byte arrives, so frames carry `frame_period_s` of audio each and
the encoder's carry-over (audio of a token period not yet complete) flows into the next
frame. `flush()` (a commit) ends the stream's current frame early, padding the last token
period with silence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metronome.audio.frontend import AudioFrontEnd, StreamingAudioEncoder
from metronome.audio.pcm import PCM16_BYTES_PER_SAMPLE


@dataclass
class AudioFrame:
    embeddings: torch.Tensor  # (num_tokens, hidden)
    audio_end_ms: float  # input stream position of the frame's last byte


class AudioFramer:
    def __init__(self, frontend: AudioFrontEnd, frame_period_s: float) -> None:
        fmt = frontend.fmt
        self.sample_rate_hz = fmt.sample_rate_hz
        self.frame_bytes = fmt.frame_bytes(frame_period_s)
        self._samples_per_token = fmt.samples_per_token
        self._encoder = StreamingAudioEncoder(frontend)
        self._pending = bytearray()  # the frame being filled: < frame_bytes
        self.received_bytes = 0

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    @property
    def bytes_per_s(self) -> int:
        return self.sample_rate_hz * PCM16_BYTES_PER_SAMPLE

    def append(self, pcm: bytes) -> list[AudioFrame]:
        """Whole PCM16 samples in; every frame completed by them out."""
        assert len(pcm) % PCM16_BYTES_PER_SAMPLE == 0, len(pcm)
        self._pending += pcm
        self.received_bytes += len(pcm)
        frames = []
        while len(self._pending) >= self.frame_bytes:
            chunk = bytes(self._pending[: self.frame_bytes])
            del self._pending[: self.frame_bytes]
            end_bytes = self.received_bytes - len(self._pending)
            frames.append(AudioFrame(self._encoder.push(chunk), self._ms(end_bytes)))
        return frames

    def flush(self) -> AudioFrame | None:
        """The partial frame (padded with silence to a whole token), or None if empty."""
        chunk = bytes(self._pending)
        self._pending.clear()
        embeddings = self._encoder.push(chunk)
        carry = self._encoder.pending_samples
        if carry:
            silence = torch.zeros(self._samples_per_token - carry)
            embeddings = torch.cat([embeddings, self._encoder.push(silence)])
        if embeddings.shape[0] == 0:
            return None
        return AudioFrame(embeddings, self._ms(self.received_bytes))

    def _ms(self, num_bytes: int) -> float:
        return num_bytes * 1000 / self.bytes_per_s
