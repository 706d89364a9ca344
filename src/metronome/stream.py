"""The one record of a session, carried from the socket to the engine: a `Stream` and its
`Frame`s.

Every layer reads and advances the same objects, as nano-vllm carries one `Sequence` and
vLLM one `Request` (nothing re-wraps them on the way):

    serve    accepts a frame, appends its input once it is prepared          (event loop)
    beat     puts frames in flight, feeds the engine, answers every frame    (event loop)
    engine   reads the fed input, writes its KV, samples                     (engine thread)

**Input has one home.** A session's input is one sequence of positions (token ids, or
embeddings from an audio front end), numbered from 0, kept here until a step consumes it:

      consumed_tokens          fed_tokens                 received_tokens
    ─────────┼────────────────────┼──────────────────────────────┼─────────── + frames being
    consumed │ fed: the engine's  │ held by the beat: the rest of │             prepared
    (dropped)│ to read, in order  │ the frame in flight, answered │             (their input
             │                    │ frames' leftovers, waiting    │             not here yet)
             │                    │ frames                        │

Each offset only grows, except that a waiting frame the user withdrew (a reply spoken over)
leaves the stream with its input, which the engine never saw. `queued_input_tokens`,
`backlog_tokens` and a frame's input left are derived from them, never counted apart.

**Threads.** The loop owns every field but the input's chunks: the engine thread reads the
input it was fed (`read`) and drops what it has read (`trim`), under `_lock`, while the
loop appends. The engine keeps its own read cursor; the loop's `consumed_tokens` advances
when a step's output reaches it.

**Context** is input that asks for no answer of its own (a turn session's text items and
instructions: the history a client restores arrives in a burst): it joins the stream
without a frame, so no count of frames and no deadline limits it, only the session's bound
on queued input. While it is being prepared it is counted at the most tokens it can make
(`preparing_context_tokens`); `context_until` is where the last of it ends.

**A frame** is created when its submitter accepts it (the server: before its audio is
encoded), takes its place in the stream once its input arrives (`index`, `start_offset`,
`end_offset`), carries its deadline and its budget of new tokens, and becomes its result
when the beat answers it: listeners and the stream's owner receive the same object. A
frame is answered exactly once. Its `tag` is its submitter's (the server: the reply the
frame answers), typed by the submitter (`Frame[Reply]`).

**Its owner** (`StreamOwner`: the server's Realtime session) hears of the stream from the
beat, after the listeners: each frame's result, each step's tokens of the frame in flight,
a bound the engine changed. The beat guards every call once: an owner that raises is
logged and told `on_failure`, and the beat goes on for every other session.
"""

from __future__ import annotations

import enum
import itertools
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch

from metronome.engine.session import SessionSpec
from metronome.engine.types import Rebound
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.profile import SessionProfile

RECENT_FRAMES = 40  # statuses a stream keeps of its last frames: 40 s at 1 s frames
Tag = TypeVar("Tag")
FrameKind = Literal["audio", "text", "response"]  # what a frame's input is (a reply's prefix)


class FrameStatus(enum.StrEnum):
    OK = "ok"  # all of the frame's work was done within its deadline
    LATE = "late"  # the deadline passed first: what was ready went out at the deadline
    # The engine had no KV block: the result went out on the beat, without the work.
    # Today's engines do this silently; we always say why.
    STALLED_KV = "stalled_kv"
    CONTEXT_FULL = "context_full"  # the session reached max_session_tokens and ended
    REJECTED = "rejected"  # refused: the session has ended or the input was invalid
    # the session closed before the frame was answered, or its owner withdrew it (a reply
    # the user talked over)
    CANCELLED = "cancelled"


@dataclass(eq=False)  # each frame is itself: compared by identity
class Frame(Generic[Tag]):
    """One period's input and the one result it always gets."""

    session_id: str
    arrival_s: float  # when the frame was complete at the server (its last byte arrived)
    respond: bool = True  # ask for output (duplex: every frame; turn: the turn's end)
    kind: FrameKind = "text"
    tag: Tag | None = None  # the submitter's own (the server: the reply it answers)
    audio_end_ms: float | None = None  # audio: the input stream's position at its last byte
    # its input's positions: at acceptance the submitter's count (audio: an estimate, before
    # it is encoded), once submitted the real count (the stream holds that many)
    input_tokens: int = 0
    # its output's budget (None: the session profile's per-frame one); a reply asks its own
    output_budget_tokens: int | None = None
    # an output stream (a turn's reply): its deadline is its first output's, and passing it
    # cuts nothing; what follows is paced by its listener (`serve.realtime.pacing`), so the
    # frame ends at its budget or the model's stop, however long that takes
    paced: bool = False
    # ---- set by the beat ------------------------------------------------------------------
    index: int | None = None  # numbered as its input reaches the stream
    deadline_at_s: float = math.inf
    max_new_tokens: int = 0  # its budget of output (0: no output asked for)
    start_offset: int | None = None  # its input's span in the stream
    end_offset: int | None = None
    queued_ahead_tokens: int = 0  # the session's input still queued ahead of it
    # the end of the session's context queued ahead of it when it was submitted: while that
    # is not processed its deadline waits (None: none was queued; `Beat.append_context`)
    behind_context_until: int | None = None
    budget_fed: bool = False  # its budget went to the engine with its last input
    # ---- its result -----------------------------------------------------------------------
    status: FrameStatus | None = None  # None: not answered yet
    reason: str = ""
    token_ids: list[int] = field(default_factory=list)
    late_token_ids: list[int] = field(default_factory=list)  # produced after it went out
    submitted_s: float | None = None  # when its input reached the stream (after preparing)
    start_s: float | None = None  # when the engine first worked on its input
    first_output_s: float | None = None  # when its first output token was ready
    finish_s: float = math.nan  # when its result was ready

    @property
    def span(self) -> tuple[int, int]:
        """Its input's offsets in the stream, (start, end): only once it is submitted."""
        assert self.start_offset is not None and self.end_offset is not None, self
        return self.start_offset, self.end_offset

    @property
    def expects_output(self) -> bool:
        return self.max_new_tokens > 0

    @property
    def own_work_tokens(self) -> int:
        """Input the engine had to process for this session before this frame was done."""
        return self.input_tokens + self.queued_ahead_tokens

    @property
    def due_s(self) -> float:
        """When what its deadline is for was ready: its result, or a paced frame's first
        output (its result, if it made none)."""
        if self.paced and self.first_output_s is not None:
            return self.first_output_s
        return self.finish_s

    @property
    def deadline_met(self) -> bool:
        # a late frame is answered *at* its deadline (on the virtual clock exactly), but its
        # work was not done: that is a miss
        return self.status is not FrameStatus.LATE and self.due_s <= self.deadline_at_s

    @property
    def latency_s(self) -> float:
        """From its arrival to its result (a paced frame: to its first output)."""
        return self.due_s - self.arrival_s

    @property
    def latency_fraction(self) -> float:
        """Latency as a share of the frame's deadline (the admission controller's signal)."""
        return self.latency_s / (self.deadline_at_s - self.arrival_s)

    @property
    def good(self) -> bool:
        """Goodput counts this frame: its work done, with output if output was asked for."""
        has_output = bool(self.token_ids) or not self.expects_output
        return self.status is FrameStatus.OK and self.deadline_met and has_output


class StreamOwner(Protocol):
    """Who a stream's news goes to, after the listeners (see the module docstring)."""

    def on_result(self, frame: Frame[Any]) -> None:
        """A frame answered (any status)."""

    def on_tokens(self, frame: Frame[Any], token_ids: list[int]) -> None:
        """A step's new tokens of the frame in flight, as they come."""

    def on_rebound(self, rebound: Rebound) -> None:
        """The engine changed the session's bound (KV pressure, the position limit, a
        re-pin)."""

    def on_failure(self) -> None:
        """One of the calls above raised (the beat logged it): the session cannot go on."""


class Stream:
    """One session (see the module docstring): its input, its frames, its outputs."""

    def __init__(self, session_id: str, profile: SessionProfile = SessionProfile(),
                 opened_at_s: float = 0.0, spec: SessionSpec | None = None,
                 owner: StreamOwner | None = None) -> None:
        self.id = session_id  # the one id of the session in the process
        self.profile = profile  # the session as a periodic real-time task
        self.spec = profile.spec if spec is None else spec  # what the engine serves it with
        self.opened_at_s = opened_at_s
        self.owner = owner  # hears of its results after the listeners (None: nobody)
        # ---- input: chunks of unconsumed input, oldest first; _chunks[0] starts at _head
        self._lock = threading.Lock()
        self._chunks: deque[torch.Tensor] = deque()  # (n,) int64 ids or (n, hidden) floats
        self._head = 0
        self.received_tokens = 0
        self.fed_tokens = 0  # how far the beat has let the engine read
        self.consumed_tokens = 0  # how far steps have processed (as reported to the loop)
        # ---- context: input that asks for no answer of its own (`Beat.append_context`) -----
        self.context_until = 0  # where the last context appended ends in the stream
        self.preparing_context_tokens = 0  # what context being prepared is counted at
        # ---- frames ---------------------------------------------------------------------------
        self.frames: deque[Frame[Any]] = deque()  # unanswered, in the order accepted
        self.in_flight: Frame[Any] | None = None  # frames[0], once its input went to the engine
        self.last_answered: Frame[Any] | None = None  # the last in flight that was answered
        # statuses of the last frames answered, any way (the status page's strip)
        self.recent_statuses: deque[FrameStatus] = deque(maxlen=RECENT_FRAMES)
        self.frames_submitted = 0  # frames whose input reached the stream (their numbering)
        self.frames_answered = 0
        self.ended_reason = ""  # the engine ended the session (context full)
        self.held_reason = ""  # its client is away (`Beat.hold`): nothing fed, frames cancelled
        self.bound: ResidencyPolicy | None = None  # set when the engine bound it under pressure
        self.resident_tokens: int | None = None  # live KV after the last step (a reading)

    @classmethod
    def of(cls, spec: SessionSpec = SessionSpec()) -> Stream:
        """A stream for direct engine use (tests, benches, experiments): a fresh id."""
        return cls(f"stream-{next(_ANONYMOUS)}", spec=spec)

    def __repr__(self) -> str:
        return (f"Stream({self.id!r}, consumed={self.consumed_tokens}, fed={self.fed_tokens}, "
                f"received={self.received_tokens}, frames={len(self.frames)})")

    # ---- input (the loop appends; the engine reads and trims) --------------------------------
    def append(self, data: torch.Tensor) -> tuple[int, int]:
        """Input at the end of the stream; its span (start, end) in the stream's offsets."""
        start = self.received_tokens
        with self._lock:
            self._chunks.append(data)
            self.received_tokens += int(data.shape[0])
        return start, self.received_tokens

    def read(self, start: int, max_tokens: int) -> torch.Tensor:
        """Up to `max_tokens` of input from offset `start` (at least `consumed_tokens`), of one
        kind (token ids or embeddings: a run stops where the kind changes). Any thread."""
        with self._lock:
            offset, n = self._head, 0
            parts: list[torch.Tensor] = []
            for chunk in self._chunks:
                size = int(chunk.shape[0])
                if offset + size <= start:
                    offset += size
                    continue
                if parts and not _same_kind(parts[0], chunk):
                    break
                piece = chunk[max(0, start - offset): max(0, start - offset) + max_tokens - n]
                parts.append(piece)
                n += int(piece.shape[0])
                offset += size
                if n >= max_tokens:
                    break
        assert parts, f"no input at offset {start} of {self!r}"
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def kind_run_end(self, start: int) -> int:
        """The offset where the run of one input kind that holds `start` ends."""
        with self._lock:
            offset, kind = self._head, None
            for chunk in self._chunks:
                size = int(chunk.shape[0])
                if offset + size > start:
                    if kind is not None and not _same_kind(kind, chunk):
                        return offset
                    kind = chunk if kind is None else kind
                offset += size
            return offset

    def trim(self, read_tokens: int) -> None:
        """The engine has read everything before `read_tokens`: chunks wholly behind it go
        (engine thread; the loop never reads the input)."""
        with self._lock:
            while self._chunks and self._head + int(self._chunks[0].shape[0]) <= read_tokens:
                self._head += int(self._chunks.popleft().shape[0])

    def consumed(self, num_tokens: int) -> None:
        """A step's output says it processed `num_tokens` more of the fed input (loop)."""
        self.consumed_tokens += num_tokens
        assert self.consumed_tokens <= self.fed_tokens, self

    def drop(self, frame: Frame[Any]) -> None:
        """A waiting frame leaves with its input (never fed); those after it move up."""
        start, end = frame.span
        assert start >= self.fed_tokens, (frame, self)
        with self._lock:
            offset = self._head
            for position, chunk in enumerate(self._chunks):
                if offset == start:
                    assert int(chunk.shape[0]) == end - start, "a frame's input is one chunk"
                    del self._chunks[position]
                    break
                offset += int(chunk.shape[0])
            else:
                raise AssertionError(f"{frame} is not in {self!r}")
            self.received_tokens -= end - start
        for later in self.frames:
            if later.end_offset is not None and later.span[0] > start:
                later_start, later_end = later.span
                later.start_offset = later_start - (end - start)
                later.end_offset = later_end - (end - start)

    # ---- derived counts ---------------------------------------------------------------------
    @property
    def policy(self) -> ResidencyPolicy:
        """The session's residency policy now: its spec's, or the pressure bound."""
        return self.spec.policy if self.bound is None else self.bound

    @property
    def last_status(self) -> FrameStatus | None:
        """The status of the last frame answered, any way (None: none yet)."""
        return self.recent_statuses[-1] if self.recent_statuses else None

    @property
    def unanswered_frames(self) -> int:
        """Frames accepted and not answered yet: being prepared, waiting or in flight."""
        return len(self.frames)

    @property
    def submitted_queued_tokens(self) -> int:
        """Input that reached the stream and no step has processed yet."""
        return self.received_tokens - self.consumed_tokens

    @property
    def queued_input_tokens(self) -> int:
        """Input accepted but not yet processed: what reached the stream, and what frames
        being prepared were counted at (the session's bound on queued input counts this)."""
        preparing = sum(f.input_tokens for f in self.frames if f.end_offset is None)
        return self.submitted_queued_tokens + preparing + self.preparing_context_tokens

    @property
    def feedable_until(self) -> int:
        """How far the engine may read: through the frame in flight (its input and every
        earlier frame's; only up to it while the context ahead of it is not in), or with none
        in flight, everything received (answered frames' leftovers: a waiting frame goes in
        flight as soon as none is)."""
        flight = self.in_flight
        if flight is None:
            return self.received_tokens
        # behind context: the context first, the frame's own input once it is in (so a
        # reply withdrawn meanwhile leaves no prompt in the KV)
        return flight.span[0] if flight.behind_context_until is not None else flight.span[1]

    @property
    def backlog_tokens(self) -> int:
        """Unprocessed input of frames already answered (queued ahead of the frame in
        flight, or of the next one)."""
        ahead_of = self.received_tokens if self.in_flight is None else self.in_flight.span[0]
        return max(0, ahead_of - self.consumed_tokens)

    @property
    def context_pending(self) -> bool:
        """Context it appended is not all processed yet."""
        return self.consumed_tokens < self.context_until

    def fits(self, num_tokens: int) -> bool:
        """Whether `num_tokens` more input keeps the queued input within the profile's
        bound (`max_queued_input_tokens`; None: no bound). The one check of that bound:
        at acceptance for an accepted frame, at submission for any other."""
        limit = self.profile.max_queued_input_tokens
        return limit is None or self.queued_input_tokens + num_tokens <= limit


_ANONYMOUS = itertools.count()  # ids of `Stream.of`'s streams


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two inputs join into one tensor: both token ids, or embeddings alike."""
    return a.dtype == b.dtype and a.shape[1:] == b.shape[1:]
