"""The one record the runtime keeps of a session: its ids, its profile, its frames from
the moment their submitter accepts them (being prepared, waiting, in flight) and what was
answered. Nothing else counts a session's unanswered frames or queued input.

    accepted (`Beat.accept`)  ->  waiting  ->  in flight  ->  answered
    |<-- prepared by the      |<-- in the beat: input validated, queued FIFO -->|
         submitter (the server encodes audio off the loop), input not yet here

The beat owns and mutates these; everyone else reads them (`Beat.sessions`): the server for
a session's unanswered frames, its queued input and `GET /v1/sessions`, experiments for who
is open.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.engine.types import PreparedInput, Rebound
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.frame import Frame, FrameResult, FrameStatus
from metronome.runtime.profile import SessionProfile


@dataclass(eq=False)  # each one is its own frame: compared by identity
class Accepted:
    """A frame its submitter has accepted and is still preparing (the server: its audio on
    the encoder thread). It counts in the session's unanswered frames and queued input from
    acceptance on; its input was checked against the session's bound then (`fits`), so it
    is not checked again when it is submitted."""

    session_id: int
    num_tokens: int  # the submitter's count of the frame's input (audio: an estimate)


@dataclass
class InFlight:
    """The frame the engine is working on for this session (one at a time)."""

    frame: Frame
    deadline_at_s: float
    max_tokens: int
    input_left: int  # of the frame's own input, not yet consumed by a step
    queued_ahead_tokens: int = 0  # the session's backlog when this frame went in flight
    token_ids: list[int] = field(default_factory=list)
    start_s: float | None = None


@dataclass
class SessionRecord:
    session_id: int  # the engine's id (issued by the engine: one allocator)
    profile: SessionProfile
    opened_at_s: float
    public_id: str | None = None  # the server's id (`sess_...`); None in local runs
    # The session's own consumer of its results (the server's Realtime session), called after
    # the driver's listeners; None: only the listeners hear of them.
    on_result: Callable[[FrameResult], None] | None = None
    # ... and of the engine bounding it under KV pressure (after the listeners' on_rebound)
    on_rebound: Callable[[Rebound], None] | None = None
    accepted: list[Accepted] = field(default_factory=list)  # in the order accepted
    waiting: deque[tuple[Frame, PreparedInput]] = field(default_factory=deque)
    in_flight: InFlight | None = None
    backlog_tokens: int = 0  # input of already-answered frames still queued in the engine
    # or held by the beat's feed (`runtime.feed`)
    last_answered: FrameResult | None = None  # receives tokens that arrive after the answer
    ended_reason: str = ""  # the engine ended the session (context full)
    frames_submitted: int = 0  # the server numbers its frames by this count
    frames_answered: int = 0
    last_status: FrameStatus | None = None
    bound: ResidencyPolicy | None = None  # set when the engine bound it under KV pressure

    @property
    def policy(self) -> ResidencyPolicy:
        """The session's residency policy now: its profile's, or the pressure bound."""
        return self.profile.policy if self.bound is None else self.bound

    @property
    def unanswered_frames(self) -> int:
        """Frames accepted and not answered yet: being prepared, waiting or in flight."""
        return len(self.accepted) + len(self.waiting) + (self.in_flight is not None)

    @property
    def queued_input_tokens(self) -> int:
        """Input accepted but not yet processed: the accepted frames' still being prepared,
        the waiting frames', the rest of the in-flight frame's and the backlog of answered
        frames (what the session's bound on queued input counts)."""
        accepted = sum(frame.num_tokens for frame in self.accepted)
        return accepted + self.submitted_queued_tokens

    @property
    def submitted_queued_tokens(self) -> int:
        """The part of the queued input that has reached the beat."""
        waiting = sum(prepared.num_tokens for _, prepared in self.waiting)
        flight = 0 if self.in_flight is None else self.in_flight.input_left
        return self.backlog_tokens + flight + waiting

    def fits(self, num_tokens: int) -> bool:
        """Whether `num_tokens` more input keeps the queued input within the profile's
        bound (`max_queued_input_tokens`; None: no bound). The one check of that bound:
        at acceptance for an accepted frame, at submission for any other."""
        limit = self.profile.max_queued_input_tokens
        return limit is None or self.queued_input_tokens + num_tokens <= limit
