"""Audio front end: PCM16 mono -> input embeddings at the model's token rate.

    PCM16 bytes ─decode─► float samples ─STFT, Slaney mel, log10─► frames every `hop_ms`
      ─stack the `hops_per_token` frames of one token period─► (num_mels * hops_per_token,)
      ─fixed seeded random projection─► (hidden,) ─scale to the model's embedding RMS─► token

WHAT IS REAL AND WHAT IS A STAND-IN. With a text LM (our bundled SmolLM2) this front end is
a stand-in for a trained audio encoder + adapter: it produces inputs with the right rate
(`token_rate_hz`, e.g. 12.5 Hz Moshi-like or 25 Hz Qwen-Omni-like), the right shape
(`hidden_size`) and the right magnitude (the RMS of the model's token embeddings), so the
serving system's compute and memory behave as with a speech model: one KV entry per audio
token, batched steps over audio frames. The model does not understand the audio. The
features are genuine log-mel spectra, but the projection is random, not trained.

Owns: the validated `AudioFormat` (the one config at the edge), the fixed projection
(`AudioFrontEnd`), and one stream's carry-over audio (`StreamingAudioEncoder`, one per
session). Streaming is exact: pushing audio in any chunking yields the embeddings of
encoding the whole signal at once (up to float rounding), because framing is causal and
each token depends only on its own period plus `window - hop` samples before it.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass

import torch

from metronome.audio.mel import causal_log_mel, mel_filterbank
from metronome.audio.pcm import PCM16_BYTES_PER_SAMPLE, decode_pcm16, pcm16_frame_bytes

# Whisper's fixed log-mel scaling ((log10 + 4) / 4) without its per-utterance max clamp,
# which needs the whole utterance and so cannot stream.
_LOG_MEL_OFFSET = 4.0
_LOG_MEL_SCALE = 4.0


def _whole(value: float, what: str) -> int:
    rounded = round(value)
    if rounded <= 0 or abs(value - rounded) > 1e-6 * max(1.0, abs(value)):
        raise ValueError(f"{what} must be a positive whole number, got {value:g}")
    return rounded


@dataclass(frozen=True)
class AudioFormat:
    sample_rate_hz: int = 24000  # OpenAI Realtime pcm16 default
    token_rate_hz: float = 12.5  # model tokens per second of audio (Moshi 12.5, Qwen-Omni 25)
    num_mels: int = 80  # Whisper's count
    hop_ms: float = 10.0  # one feature frame per hop
    window_ms: float = 25.0  # Hann window; also the FFT size
    f_min_hz: float = 0.0
    f_max_hz: float | None = None  # None: Nyquist

    def __post_init__(self) -> None:
        rate = self.sample_rate_hz
        if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
            raise ValueError(f"sample_rate_hz must be a positive int, got {rate!r}")
        if not self.token_rate_hz > 0 or not math.isfinite(self.token_rate_hz):
            raise ValueError(f"token_rate_hz must be positive and finite, got {self.token_rate_hz}")
        if not isinstance(self.num_mels, int) or self.num_mels <= 0:
            raise ValueError(f"num_mels must be a positive int, got {self.num_mels!r}")
        if not 0 < self.hop_ms <= self.window_ms:
            raise ValueError(
                f"need 0 < hop_ms <= window_ms, got hop_ms={self.hop_ms}, "
                f"window_ms={self.window_ms}"
            )
        self._check_whole_counts()
        if not 0 <= self.f_min_hz < self.max_freq_hz <= rate / 2:
            raise ValueError(
                f"need 0 <= f_min_hz < f_max_hz <= Nyquist ({rate / 2:g} Hz), got "
                f"f_min_hz={self.f_min_hz}, f_max_hz={self.f_max_hz}"
            )

    def _check_whole_counts(self) -> None:
        at = f"at {self.sample_rate_hz} Hz"
        period_ms = 1000 / self.token_rate_hz
        samples_per_ms = self.sample_rate_hz / 1000
        _whole(self.hop_ms * samples_per_ms, f"hop ({self.hop_ms} ms {at}) in samples")
        _whole(self.window_ms * samples_per_ms, f"window ({self.window_ms} ms {at}) in samples")
        period = f"token period ({period_ms:g} ms"
        _whole(period_ms * samples_per_ms, f"{period} {at}) in samples")
        _whole(period_ms / self.hop_ms, f"{period}) in hops ({self.hop_ms} ms)")

    @property
    def hop_samples(self) -> int:
        return round(self.sample_rate_hz * self.hop_ms / 1000)

    @property
    def window_samples(self) -> int:
        return round(self.sample_rate_hz * self.window_ms / 1000)

    @property
    def context_samples(self) -> int:
        """Audio before a token period that its first frame's window reaches back into."""
        return self.window_samples - self.hop_samples

    @property
    def samples_per_token(self) -> int:
        return round(self.sample_rate_hz / self.token_rate_hz)

    @property
    def hops_per_token(self) -> int:
        return self.samples_per_token // self.hop_samples

    @property
    def token_period_s(self) -> float:
        return 1.0 / self.token_rate_hz

    @property
    def bytes_per_token(self) -> int:
        return self.samples_per_token * PCM16_BYTES_PER_SAMPLE

    @property
    def max_freq_hz(self) -> float:
        return self.sample_rate_hz / 2 if self.f_max_hz is None else self.f_max_hz

    def frame_bytes(self, frame_period_s: float) -> int:
        """PCM16 bytes in one frame of `frame_period_s` at this sample rate."""
        return pcm16_frame_bytes(self.sample_rate_hz, frame_period_s)


class AudioFrontEnd:
    """Stateless and shared by all sessions: audio -> (num_tokens, hidden_size) embeddings.

    Every output token has RMS exactly `embed_rms` (up to rounding): the projection is
    followed by an RMS normalisation, so loudness changes the direction, not the size.
    """

    def __init__(
        self,
        fmt: AudioFormat,
        hidden_size: int,
        embed_rms: float,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        if not embed_rms > 0:
            raise ValueError(f"embed_rms must be positive, got {embed_rms}")
        self.fmt = fmt
        self.hidden_size = hidden_size
        self.embed_rms = float(embed_rms)
        self.dtype = dtype
        self._window = torch.hann_window(fmt.window_samples, periodic=True)
        self._filterbank = mel_filterbank(  # (window_samples // 2 + 1, num_mels)
            fmt.sample_rate_hz, fmt.window_samples, fmt.num_mels, fmt.f_min_hz, fmt.max_freq_hz
        )
        in_features = fmt.num_mels * fmt.hops_per_token
        generator = torch.Generator().manual_seed(seed)
        # Stand-in for a trained encoder + adapter; the scale only keeps values near 1.
        self._projection = torch.randn(  # (num_mels * hops_per_token, hidden)
            in_features, hidden_size, generator=generator
        ) / math.sqrt(in_features)

    @classmethod
    def for_model(
        cls, embed_tokens: torch.Tensor, fmt: AudioFormat, seed: int = 0
    ) -> AudioFrontEnd:
        """Match the model's token embeddings (vocab, hidden): their RMS, width and dtype."""
        embed_rms = embed_tokens.detach().float().pow(2).mean().sqrt().item()
        return cls(fmt, embed_tokens.shape[1], embed_rms, seed=seed, dtype=embed_tokens.dtype)

    def encode(self, samples: torch.Tensor) -> torch.Tensor:
        """Whole signal (n,) -> (n // samples_per_token, hidden); a trailing partial token
        is dropped (a stream would keep it pending)."""
        num_samples = samples.numel() // self.fmt.samples_per_token * self.fmt.samples_per_token
        return self.embed_padded(self._left_pad(samples[:num_samples]))

    def log_mel(self, samples: torch.Tensor) -> torch.Tensor:
        """Causal log10-mel frames of a whole signal (n,): (n // hop_samples, num_mels)."""
        num_samples = samples.numel() // self.fmt.hop_samples * self.fmt.hop_samples
        if num_samples == 0:
            return torch.empty(0, self.fmt.num_mels)
        padded = self._left_pad(samples[:num_samples])
        return causal_log_mel(padded, self.fmt.hop_samples, self._window, self._filterbank)

    def embed_padded(self, padded: torch.Tensor) -> torch.Tensor:
        """`context_samples` of left context + whole token periods -> (num_tokens, hidden)."""
        fmt = self.fmt
        num_tokens, rest = divmod(padded.numel() - fmt.context_samples, fmt.samples_per_token)
        assert rest == 0 and num_tokens >= 0, (padded.numel(), fmt)
        if num_tokens == 0:
            return torch.empty(0, self.hidden_size, dtype=self.dtype)
        log_mel = causal_log_mel(padded, fmt.hop_samples, self._window, self._filterbank)
        features = (log_mel + _LOG_MEL_OFFSET) / _LOG_MEL_SCALE  # (T * hops, num_mels)
        stacked = features.reshape(num_tokens, -1)  # (T, hops_per_token * num_mels), time-major
        projected = stacked @ self._projection  # (T, hidden)
        rms = projected.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
        return (projected * (self.embed_rms / rms)).to(self.dtype)

    def _left_pad(self, samples: torch.Tensor) -> torch.Tensor:
        # The start of a stream: silence before the first sample.
        context = torch.zeros(self.fmt.context_samples)
        return torch.cat([context, _as_samples(samples)])


def _as_samples(samples: torch.Tensor) -> torch.Tensor:
    if samples.dim() != 1:
        raise ValueError(f"audio must be mono samples of shape (n,), got {tuple(samples.shape)}")
    if not samples.is_floating_point():
        raise ValueError(f"audio samples must be float in [-1, 1], got {samples.dtype}")
    return samples.detach().to(device="cpu", dtype=torch.float32)


class StreamingAudioEncoder:
    """One session's stream: push audio in any chunking, get every token whose period is
    complete; the rest waits for the next push.

    Buffer layout between pushes (never more than one token period + window of audio):

        | context: window - hop samples | pending: < samples_per_token samples |
          (zeros at stream start)

    A chunk of bytes may split a sample; the odd byte waits for the next chunk.
    """

    def __init__(self, frontend: AudioFrontEnd) -> None:
        self.frontend = frontend
        self.reset()

    def reset(self) -> None:
        """Forget all audio: the next push starts a new stream (after silence)."""
        self._buffer = torch.zeros(self.frontend.fmt.context_samples)  # (context + pending,)
        self._odd_byte = b""

    @property
    def pending_samples(self) -> int:
        return self._buffer.numel() - self.frontend.fmt.context_samples

    def saved(self) -> dict:
        """Its stream state (context and pending samples, a split byte), for a checkpoint
        (`serve.resume.checkpoint`); `load` puts it back. Only while no push is under way."""
        return {"buffer": base64.b64encode(self._buffer.float().numpy().tobytes()).decode(),
                "odd_byte": base64.b64encode(self._odd_byte).decode()}

    def load(self, saved: dict) -> None:
        raw = bytearray(base64.b64decode(saved["buffer"]))
        self._buffer = torch.frombuffer(raw, dtype=torch.float32).clone()
        self._odd_byte = base64.b64decode(saved["odd_byte"])
        assert 0 <= self.pending_samples < self.frontend.fmt.samples_per_token

    def push(self, audio: torch.Tensor | bytes) -> torch.Tensor:
        """Append audio (float samples (n,) or PCM16 bytes); returns (k, hidden), k >= 0."""
        fmt = self.frontend.fmt
        self._buffer = torch.cat([self._buffer, self._samples_of(audio)])
        num_tokens = self.pending_samples // fmt.samples_per_token
        consumed = num_tokens * fmt.samples_per_token
        embeddings = self.frontend.embed_padded(self._buffer[: fmt.context_samples + consumed])
        # clone: a view would keep the whole pushed chunk's storage alive.
        self._buffer = self._buffer[consumed:].clone()
        assert 0 <= self.pending_samples < fmt.samples_per_token, self.pending_samples
        return embeddings

    def _samples_of(self, audio: torch.Tensor | bytes) -> torch.Tensor:
        if isinstance(audio, torch.Tensor):
            if self._odd_byte:
                raise ValueError("float samples pushed while half a PCM16 sample is pending")
            return _as_samples(audio)
        data = self._odd_byte + bytes(audio)
        whole = len(data) // PCM16_BYTES_PER_SAMPLE * PCM16_BYTES_PER_SAMPLE
        self._odd_byte = data[whole:]
        return decode_pcm16(data[:whole])
