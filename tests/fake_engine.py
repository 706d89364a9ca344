"""An `EnginePort` without a model, for driving the beat in exact tests (as vLLM's scheduler
tests drive its scheduler with no model runner).

Each step takes up to `chunk_tokens` of each session's fed input, after its own last
sampled token when that is to be written back, like the native engine; once a session's
fed input is all read and it has a budget, it samples `TOKEN_BASE + n` (n: the tokens it has
sampled so far). Sessions named in `stalled` report `stalled_kv` and read nothing; sessions
named in `ended` report `context_full` once and never work again. `fed` logs every feed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from metronome.engine.engine import EngineConfig, SessionError, check_token_ids
from metronome.engine.types import PoolStats, StepOutput, WorkStatus
from metronome.kv.residency import ResidencyPolicy
from metronome.stream import Stream

TOKEN_BASE = 100
VOCAB = 1000


@dataclass
class _Session:
    stream: Stream
    fed: int = 0
    read: int = 0
    budget: int = 0
    feedback: bool = False  # its own sampled token is to be written next
    sampled: int = 0
    ended: bool = False
    fed_log: list[tuple[int, int]] = field(default_factory=list)  # (tokens, budget) per feed

    @property
    def unread(self) -> int:
        return self.feedback + self.fed - self.read


class FakeEngine:
    accepts_embeddings = True

    def __init__(self, chunk_tokens: int = 64, hidden_size: int = 8) -> None:
        self.config = EngineConfig(block_size=16, pool_tokens=1024, max_chunk_tokens=chunk_tokens,
                                   max_prefill_chunk_tokens=max(chunk_tokens, 256))
        self.hidden_size = hidden_size
        self.sessions: dict[str, _Session] = {}
        self.stalled: set[str] = set()
        self.ended: set[str] = set()
        self.closed: list[str] = []

    def check_input(self, token_ids, embeddings) -> torch.Tensor | None:
        if token_ids is not None and embeddings is not None:
            raise SessionError("submit token_ids or embeddings, not both")
        if token_ids is not None:
            return check_token_ids(token_ids, VOCAB)
        if embeddings is not None:
            if embeddings.dim() != 2 or embeddings.shape[1] != self.hidden_size:
                raise SessionError(f"embeddings must be (n, {self.hidden_size})")
            return embeddings
        return None

    def open_session(self, stream: Stream) -> str:
        if stream.id in self.sessions:
            raise SessionError(f"session {stream.id} is already open")
        self.sessions[stream.id] = _Session(stream)
        return stream.id

    def feed(self, session_id: str, num_tokens: int, max_new_tokens: int = 0) -> None:
        session = self.sessions[session_id]
        assert session.fed + num_tokens <= session.stream.received_tokens
        session.fed += num_tokens
        session.budget += max_new_tokens
        session.fed_log.append((num_tokens, max_new_tokens))

    def fed(self, session_id: str) -> torch.Tensor:
        """Every input position fed to the session so far, as the stream held it."""
        session = self.sessions[session_id]
        return session.stream.read(0, session.fed) if session.fed else torch.empty(0)

    def cancel_generation(self, session_id: str) -> None:
        self.sessions[session_id].budget = 0

    def close(self, session_id: str) -> None:
        del self.sessions[session_id]
        self.closed.append(session_id)

    @property
    def has_work(self) -> bool:
        return any(s.unread and not s.ended for s in self.sessions.values())

    def step(self) -> StepOutput:
        out = StepOutput()
        for sid, session in self.sessions.items():
            if not session.unread or session.ended:
                continue
            if sid in self.ended:
                session.ended = True
                out.status[sid] = WorkStatus.CONTEXT_FULL
                continue
            if sid in self.stalled:
                out.status[sid] = WorkStatus.STALLED_KV
                continue
            own = int(session.feedback)
            fed = min(self.config.max_chunk_tokens - own, session.fed - session.read)
            session.feedback = False
            session.read += fed
            out.status[sid] = WorkStatus.OK
            out.input_tokens[sid] = own + fed
            out.consumed_tokens[sid] = fed
            out.new_token_ids[sid] = []
            out.context_tokens[sid] = session.read
            if session.read == session.fed and session.budget > 0:
                out.new_token_ids[sid].append(TOKEN_BASE + session.sampled)
                session.sampled += 1
                session.budget -= 1
                session.feedback = session.budget > 0
            if session.budget > 0:
                out.generating.add(sid)
        return out

    def pool_stats(self) -> PoolStats:
        return PoolStats(64, 16, 0, 64, 0)

    def resident_tokens_by_session(self) -> dict[str, int]:
        return {sid: s.read for sid, s in self.sessions.items()}

    def memory_ceiling(self, policy: ResidencyPolicy) -> int | None:
        return None

    def warm_up(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
