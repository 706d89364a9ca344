"""A Realtime session's settings: its mode, input rate and turn detection, as
`session.update` sets them and `session.created` / `session.updated` describe them.

Validated here against what the server serves (`ClientError` for anything else, the
settings unchanged); whether they may still change (mode and rate are fixed once input has
started) is the session's to say, since it knows what has been sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.profile import SessionMode, SessionProfile
from metronome.serve import protocol as p
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol.schema import (
    AudioFormatOut,
    AudioInputOut,
    AudioOut,
    AudioOutputOut,
    MetronomeSessionOut,
    ResumeOut,
    SessionOut,
    Transcription,
)
from metronome.serve.voice.pipeline import OUTPUT_RATE_HZ

VOICE_NAME = "joe"  # the one voice served (Piper en_US joe, medium)


@dataclass(frozen=True)
class SessionSettings:
    mode: SessionMode
    sample_rate_hz: int
    turns: p.ServerVad | None = None  # server VAD; None: the client commits
    speak: bool = False  # output_modalities ["audio"]: replies are spoken
    transcription: Transcription | None = None  # the client wants transcription events
    max_output_tokens: int | Literal["inf"] = "inf"  # a reply's budget ("inf": the server's)

    def reply_budget_tokens(self, config: ServerConfig,
                            asked: int | Literal["inf"] | None = None) -> int:
        """A turn's reply's budget: what `response.create` asked (`asked`), else the
        session's, within the server's `max_response_tokens` ("inf": that ceiling)."""
        budget = self.max_output_tokens if asked is None else asked
        ceiling = config.max_response_tokens
        return ceiling if budget == "inf" else min(budget, ceiling)

    @classmethod
    def defaults(cls, config: ServerConfig, speaks: bool = False) -> SessionSettings:
        """A new session's: the server's mode and rate, server VAD if it is on, spoken
        replies if the server has a voice and `output_audio` is on."""
        turns = p.ServerVad(type="server_vad") if config.server_vad else None
        return cls(config.mode, config.default_sample_rate_hz, turns,
                   speaks and config.output_audio)

    def saved(self) -> dict:
        """As JSON, for a checkpoint (`serve.resume`)."""
        return {"mode": self.mode.value, "sample_rate_hz": self.sample_rate_hz,
                "turns": None if self.turns is None else self.turns.model_dump(mode="json"),
                "speak": self.speak, "transcription": None if self.transcription is None
                else self.transcription.model_dump(mode="json"),
                "max_output_tokens": self.max_output_tokens}

    @classmethod
    def load(cls, saved: dict) -> SessionSettings:
        turns, transcription = saved["turns"], saved.get("transcription")
        return cls(SessionMode(saved["mode"]), saved["sample_rate_hz"],
                   None if turns is None else p.ServerVad.model_validate(turns),
                   saved.get("speak", False),
                   None if transcription is None else Transcription.model_validate(
                       transcription), saved.get("max_output_tokens", "inf"))

    def updated(self, update: p.SessionIn, config: ServerConfig,
                has_tokenizer: bool, speaks: bool = False,
                hears: bool = False) -> SessionSettings:
        """These settings with `update` applied; raises `ClientError` for what is not
        served (a rate, or server VAD creating text responses without a tokenizer);
        `speaks` / `hears`: the server has a voice / transcribes audio."""
        mode, rate_hz = self.mode, self.sample_rate_hz
        speak, transcription = self.speak, self.transcription
        if update.output_modalities is not None:
            speak = speaks and "audio" in update.output_modalities
        audio_in = update.audio.input if update.audio else None
        if audio_in is not None and "transcription" in audio_in.model_fields_set:
            transcription = audio_in.transcription if hears else None
        if update.metronome is not None and update.metronome.mode is not None:
            mode = SessionMode(update.metronome.mode)
        if audio_in is not None and audio_in.format is not None:
            if audio_in.format.type != "audio/pcm":
                raise ClientError(ErrorCode.UNSUPPORTED, f"input audio {audio_in.format.type} "
                                  "is not served: send audio/pcm (PCM16 little-endian mono)",
                                  "session.audio.input.format.type")
            rate_hz = audio_in.format.rate
        if rate_hz not in config.sample_rates_hz:
            raise ClientError(
                ErrorCode.UNSUPPORTED_SAMPLE_RATE,
                f"rate {rate_hz} Hz is not served; use one of {config.sample_rates_hz}",
                "session.audio.input.format.rate",
            )
        turns = self.turns
        if audio_in is not None and "turn_detection" in audio_in.model_fields_set:
            chosen = audio_in.turn_detection
            # semantic_vad: no turn-end model is served, so the closest that is, with the
            # client's choices (`SessionIn.not_honored` says so)
            turns = p.ServerVad(type="server_vad", **chosen.model_dump(
                include={"create_response", "interrupt_response"}, exclude_none=True)) if (
                isinstance(chosen, p.SemanticVad)) else chosen
        if (turns is not None and turns.create_response and mode is SessionMode.TURN
                and not has_tokenizer):
            raise ClientError(ErrorCode.TEXT_UNSUPPORTED, "this model has no tokenizer, so "
                              "server VAD cannot create text responses: set create_response "
                              "to false", "session.audio.input.turn_detection.create_response")
        asked = checked_max_output_tokens(update.max_output_tokens, "session.max_output_tokens")
        return SessionSettings(mode, rate_hz, turns, speak, transcription,
                               self.max_output_tokens if asked is None else asked)

    def describe(self, session_id: str, model_name: str, profile: SessionProfile,
                 policy: ResidencyPolicy, token_rate_hz: float, instructions: str | None,
                 extensions: bool, resume: ResumeOut | None = None,
                 truncation="auto") -> SessionOut:
        """The session as `session.created` / `session.updated` tell it, the effective values
        (`serve.protocol.schema`); `policy`: the KV bound in force (the profile's, or the one
        KV pressure imposed); `truncation`: the session's choice in force
        (`serve.realtime.bound`); the `metronome` block only for a client that opted in."""
        return SessionOut(
            id=session_id, model=model_name, instructions=instructions, truncation=truncation,
            output_modalities=["audio"] if self.speak else ["text"],
            audio=AudioOut(input=AudioInputOut(
                format=AudioFormatOut(rate=self.sample_rate_hz),
                turn_detection=self.turns, transcription=self.transcription),
                output=AudioOutputOut(format=AudioFormatOut(rate=OUTPUT_RATE_HZ),
                                      voice=VOICE_NAME) if self.speak else None),
            max_output_tokens=(profile.max_output_tokens_per_frame
                               if self.mode is SessionMode.DUPLEX else self.max_output_tokens),
            metronome=None if not extensions else MetronomeSessionOut(
                mode=self.mode.value, frame_period_s=profile.frame_period_s,
                deadline_s=profile.deadline_s,
                output_tokens_per_frame=profile.max_output_tokens_per_frame,
                policy=str(policy), token_rate_hz=token_rate_hz, resume=resume,
            ),
        )


MAX_OUTPUT_TOKENS = 4096  # OpenAI's ceiling for a response's max_output_tokens


def checked_max_output_tokens(value: int | Literal["inf"] | None,
                              param: str) -> int | Literal["inf"] | None:
    """`max_output_tokens` as OpenAI takes it: 1 to 4096, or "inf" (None: not given)."""
    if value is not None and value != "inf" and not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise ClientError(ErrorCode.INVALID_VALUE, f"max_output_tokens must be 1 to "
                          f"{MAX_OUTPUT_TOKENS} or \"inf\", got {value}", param)
    return value
