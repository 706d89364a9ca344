"""What a Realtime session needs of its server (`serve.state` provides it), and a frame's
input as the encoder thread makes it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from metronome.audio.frontend import AudioFrontEnd
from metronome.engine.types import Rebound
from metronome.runtime.frame import Frame, FrameResult, count_input_tokens
from metronome.runtime.profile import SessionProfile
from metronome.runtime.record import Accepted, SessionRecord
from metronome.serve.config import ServerConfig
from metronome.serve.text import ChatText
from metronome.serve.turn_detection import VadHost


class SessionHost(VadHost, Protocol):
    config: ServerConfig
    model_name: str
    chat: ChatText | None  # None: the model has no tokenizer (presets): audio only

    def frontend(self, sample_rate_hz: int) -> AudioFrontEnd: ...

    @property
    def accepts_audio(self) -> bool: ...

    def encode(self, work: Callable[[], Input]) -> asyncio.Future[Input]:
        """Run `work` on the audio encoder thread, in call order."""

    def open_session(self, profile: SessionProfile, public_id: str,
                     on_result: Callable[[FrameResult], None],
                     on_rebound: Callable[[Rebound], None]) -> int: ...

    def adopt_session(self, profile: SessionProfile, public_id: str, engine_session_id: int,
                      on_result: Callable[[FrameResult], None],
                      on_rebound: Callable[[Rebound], None], frames_submitted: int,
                      bound: str | None) -> None:
        """Serve an engine session restored from a checkpoint (`serve.checkpoint`)."""

    def settled(self, session) -> None:
        """A frame result of `session` was handled (a checkpoint may be due)."""

    def record(self, engine_session_id: int) -> SessionRecord: ...

    def close_session(self, engine_session_id: int) -> None: ...

    def accept(self, engine_session_id: int, num_tokens: int) -> Accepted: ...

    def withdraw(self, accepted: Accepted) -> None: ...

    def submit(self, frame: Frame, accepted: Accepted) -> None: ...

    def cancel_frame(self, engine_session_id: int, index: int, reason: str) -> bool: ...

    def now_s(self) -> float: ...


@dataclass(frozen=True)
class Input:
    """One frame's input, made on the encoder thread: token ids or embeddings."""

    token_ids: list[int] | torch.Tensor | None = None
    embeddings: torch.Tensor | None = None

    @classmethod
    def of_tokens(cls, token_ids: list[int]) -> Input:
        """Token ids as an int64 tensor, made here on the encoder thread: the loop's check of
        a frame (`check_token_ids`) is then a min and a max, not a conversion of each id
        (~0.3-0.9 ms on the loop for a 4,000-character text's ~2,600 ids)."""
        return cls(token_ids=torch.tensor(token_ids, dtype=torch.int64))

    @property
    def num_tokens(self) -> int:
        return count_input_tokens(self.token_ids, self.embeddings)
