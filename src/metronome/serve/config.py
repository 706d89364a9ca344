"""The server's one config, validated once at the edge (`metronome serve` options).

Lower layers take plain values derived here: a `SessionProfile` per session mode, an
`AudioFormat` per accepted sample rate, an `EngineConfig`.
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from metronome.audio.frontend import AudioFormat
from metronome.engine.engine import EngineConfig
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.profile import GenerationMode, SessionProfile


class SessionMode(enum.StrEnum):
    DUPLEX = "duplex"  # every complete frame of audio gets a response (Moshi, MiniCPM-o)
    TURN = "turn"  # audio is prefilled as it arrives; replies come on `response.create`


class ServerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: str = "bundled"  # 'bundled', a Hugging Face directory, or preset:NAME[:LAYERS]
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    policy: str = "sinks_window:4:512"  # every session's residency policy (the KV bound)
    pool_tokens: int = Field(65536, ge=16)
    block_size: int = Field(16, ge=1)
    # Session timing. 1 s frames: the Qwen-Omni / MiniCPM-o chunk size; 0.08 s is Moshi's.
    frame_period_s: float = Field(1.0, ge=0.01, le=60)
    deadline_fraction: float = Field(1.0, gt=0, le=10)
    output_tokens_per_frame: int = Field(4, ge=1)  # duplex: tokens generated per frame
    response_tokens: int = Field(16, ge=1)  # turn: tokens of one reply (stops early at EOS)
    mode: SessionMode = SessionMode.DUPLEX  # a session may choose with `session.update`
    sample_rates_hz: tuple[int, ...] = (16000, 24000, 48000)  # accepted `audio/pcm` rates
    default_sample_rate_hz: int = 24000  # the OpenAI Realtime default
    token_rate_hz: float = Field(12.5, gt=0)  # audio tokens per second (Moshi: 12.5)
    # Admission at connect: aimd (cap starts at admission_cap) | static (fixed) | off.
    admission: Literal["aimd", "static", "off"] = "aimd"
    admission_cap: int = Field(4, ge=1)
    admission_interval_s: float = Field(2.0, gt=0)
    api_key: SecretStr | None = None  # when set, everything but /healthz needs the bearer key
    # Limits on what one client may do; each breach is answered with an `error` event.
    max_message_bytes: int = Field(1 << 20, ge=1024)  # 1 MiB: ~16 s of 24 kHz audio per append
    max_buffered_audio_s: float = Field(4.0, gt=0)  # unanswered audio; more is refused
    max_text_chars: int = Field(8192, ge=1)
    idle_timeout_s: float = Field(60.0, gt=0)
    max_session_s: float = Field(3600.0, gt=0)  # OpenAI's limit is 60 min as well
    max_outbox_events: int = Field(4096, ge=16)  # server events a slow reader may leave queued

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        policy, engine = ResidencyPolicy.parse(self.policy), self.engine_config()
        if policy.bounded and policy.window_tokens > engine.max_window_tokens:
            raise ValueError(f"window {policy.window_tokens} exceeds the engine's limit "
                             f"{engine.max_window_tokens}")
        if policy.sink_tokens > engine.max_sink_tokens:
            raise ValueError(f"sinks {policy.sink_tokens} exceed the engine's limit "
                             f"{engine.max_sink_tokens}")
        if self.default_sample_rate_hz not in self.sample_rates_hz:
            raise ValueError("default_sample_rate_hz must be one of sample_rates_hz")
        token_period_s = 1 / self.token_rate_hz
        if self.frame_period_s < token_period_s - 1e-9:
            raise ValueError(
                f"frame_period_s ({self.frame_period_s}) must hold at least one audio token "
                f"({token_period_s:g} s at {self.token_rate_hz} Hz)"
            )
        if self.max_buffered_audio_s < 2 * self.frame_period_s:
            raise ValueError("max_buffered_audio_s must be at least two frame periods")
        for rate_hz in self.sample_rates_hz:
            self.audio_format(rate_hz).frame_bytes(self.frame_period_s)
        return self

    def audio_format(self, sample_rate_hz: int) -> AudioFormat:
        return AudioFormat(sample_rate_hz=sample_rate_hz, token_rate_hz=self.token_rate_hz)

    def profile(self, mode: SessionMode) -> SessionProfile:
        duplex = mode is SessionMode.DUPLEX
        return SessionProfile(
            frame_period_s=self.frame_period_s,
            deadline_fraction=self.deadline_fraction,
            max_output_tokens_per_frame=(
                self.output_tokens_per_frame if duplex else self.response_tokens
            ),
            mode=GenerationMode.FREE if duplex else GenerationMode.TURN,
            policy=ResidencyPolicy.parse(self.policy),
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(block_size=self.block_size, pool_tokens=self.pool_tokens)

    @property
    def ws_max_message_bytes(self) -> int:
        """The transport's hard cap: larger messages are closed with 1009 by uvicorn before
        they reach us; between `max_message_bytes` and this, we answer an `error` event."""
        return 4 * self.max_message_bytes
