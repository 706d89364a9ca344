"""One session's audio input: base64 PCM16 in any chunking -> frames of `frame_period_s`.

Two halves on two threads. `cut` and `cut_rest` run on the event loop and only move bytes:
a frame is cut the moment its last byte arrives, so frames carry `frame_period_s` of audio
each. `encode` runs on the hear stage's thread (log-mel + projection, the costly
part) and owns the session's streaming encoder, whose carry-over (audio of a token period
not yet complete) flows into the next frame. Frames are encoded in the order they were cut.
A final cut (a commit) ends the stream's current frame early, padding the last token period
with silence. `decode_pcm16` reads an append's audio (`ClientError` if it is not whole
16-bit samples in base64); `decoded_bytes` says how much it decodes to, from its length.
"""

from __future__ import annotations

import base64
import binascii
import math

import torch

from metronome.audio.frontend import AudioFrontEnd, StreamingAudioEncoder
from metronome.audio.pcm import PCM16_BYTES_PER_SAMPLE
from metronome.serve.protocol import ClientError, ErrorCode


def decoded_bytes(audio_b64: str) -> int:
    """The bytes base64 text decodes to, from its length and padding alone (exact for valid
    base64; what is not valid is refused by `decode_pcm16`)."""
    padding = 2 if audio_b64.endswith("==") else 1 if audio_b64.endswith("=") else 0
    return max(0, len(audio_b64) // 4 * 3 - padding)


def decode_pcm16(audio_b64: str) -> bytes:
    try:
        pcm = base64.b64decode(audio_b64, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ClientError(ErrorCode.INVALID_AUDIO, f"audio is not valid base64: {err}",
                          "audio") from None
    if not pcm or len(pcm) % PCM16_BYTES_PER_SAMPLE:
        raise ClientError(ErrorCode.INVALID_AUDIO, f"audio/pcm needs whole 16-bit samples; got "
                          f"{len(pcm)} bytes", "audio")
    return pcm


class AudioFramer:
    def __init__(self, frontend: AudioFrontEnd, frame_period_s: float) -> None:
        fmt = frontend.fmt
        self.sample_rate_hz = fmt.sample_rate_hz
        self.token_rate_hz = fmt.token_rate_hz
        self.frame_bytes = fmt.frame_bytes(frame_period_s)
        self._samples_per_token = fmt.samples_per_token
        self._encoder = StreamingAudioEncoder(frontend)  # the hear stage's only
        self._pending = bytearray()  # the frame being filled: < frame_bytes (the loop's)
        self.received_bytes = 0

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    @property
    def bytes_per_s(self) -> int:
        return self.sample_rate_hz * PCM16_BYTES_PER_SAMPLE

    def tokens(self, num_bytes: int) -> int:
        """Input tokens `num_bytes` of audio make, rounded up (what a session's bound on
        queued input counts before the audio is encoded)."""
        return math.ceil(num_bytes / self.bytes_per_s * self.token_rate_hz)

    @property
    def received_ms(self) -> float:
        """The input stream's position: every byte received so far, in ms of audio."""
        return self._ms(self.received_bytes)

    # ---- on the loop ---------------------------------------------------------------------
    def cut(self, pcm: bytes) -> list[tuple[bytes, float]]:
        """Whole PCM16 samples in; every frame completed by them out: its bytes and the input
        stream's position at its last byte (ms)."""
        assert len(pcm) % PCM16_BYTES_PER_SAMPLE == 0, len(pcm)
        self._pending += pcm
        self.received_bytes += len(pcm)
        cuts = []
        while len(self._pending) >= self.frame_bytes:
            chunk = bytes(self._pending[: self.frame_bytes])
            del self._pending[: self.frame_bytes]
            end_bytes = self.received_bytes - len(self._pending)
            cuts.append((chunk, self._ms(end_bytes)))
        return cuts

    def saved(self) -> dict:
        """The framing and the encoder's stream state, for a checkpoint (`serve.resume`): only
        between frames, when no encode is under way."""
        return {"received_bytes": self.received_bytes,
                "pending": base64.b64encode(self._pending).decode(),
                "encoder": self._encoder.saved()}

    def load(self, saved: dict) -> None:
        self.received_bytes = saved["received_bytes"]
        self._pending = bytearray(base64.b64decode(saved["pending"]))
        assert len(self._pending) < self.frame_bytes, len(self._pending)
        self._encoder.load(saved["encoder"])

    def pending(self) -> bytes:
        """The partial frame's bytes, left where they are (a pass that hears ahead)."""
        return bytes(self._pending)

    def clear_pending(self) -> None:
        """Drop the partial frame (`input_audio_buffer.clear`); the stream position stays."""
        self._pending.clear()

    def cut_rest(self) -> tuple[bytes, float]:
        """The partial frame (a commit): encode it `final`, padded to a whole token."""
        chunk = bytes(self._pending)
        self._pending.clear()
        return chunk, self._ms(self.received_bytes)

    # ---- on the hear stage ------------------------------------------------------------------
    def encode(self, pcm: bytes, final: bool = False) -> torch.Tensor:
        """(num_tokens, hidden) embeddings of a frame's bytes; `final` (a commit): the last
        token period padded with silence. May be empty (a final frame of nothing)."""
        embeddings = self._encoder.push(pcm)
        carry = self._encoder.pending_samples
        if final and carry:
            silence = torch.zeros(self._samples_per_token - carry)
            embeddings = torch.cat([embeddings, self._encoder.push(silence)])
        return embeddings

    def _ms(self, num_bytes: int) -> float:
        return num_bytes * 1000 / self.bytes_per_s
