"""How much of each session's input the engine may see: the beat's fair, deadline-aware feed.

The engine plans a step from the input it holds (round-robin, up to `max_chunk_tokens` per
session from the head of its queue) and knows nothing of deadlines. So the beat decides
what reaches it: a session's input waits here, in order (`SessionFeed`), and goes to the
engine in pieces as `FeedPolicy` allows.

* A session **on pace** (at most one frame of its own, `ahead_tokens` or less of input
  queued) has its input handed over whole, at once, as it always was.
* A session **ahead** of real time (a frame queued behind its own in-flight frame, or more
  than `ahead_tokens` of input queued: audio sent faster than real time, a flood of text)
  has at most `fair_tokens` in the engine while any on-pace session has a frame in flight
  (**contended**): its prefill takes one frame's share of a step, as a real-time streamer's
  frame does, and the step stays short, so the due frames meet their deadlines.
* Nobody else waiting: an ahead session has up to `free_engine_tokens` (one full chunk) in
  the engine, so its prefill runs at full chunks; one chunk is also all that runs before it
  falls back to `fair_tokens` when a frame comes due (two chunks measured slower: the due
  frames waited behind both).
* **Alone**: no other session is live (none has a frame under way, or had one arrive
  within `LIVE_PERIODS` of its frame periods, whether on pace or ahead): an ahead session
  has up to `alone_engine_tokens` (the engine's `max_prefill_chunk_tokens`) in the engine,
  so a long prompt runs at the engine's large prefill chunks (`engine.chunking`) instead of
  a frame's chunk. A real-time session that speaks up waits at most for the one step under
  way. Other *ahead* sessions count as live: streamers fallen behind are ahead, and under
  overload (everyone behind) they would all get large pieces (40 streaming sessions, one
  run each: goodput 0.957 and 0.969 with that vs 1.000 without; a later run with this rule
  gave 0.950: at 40 sessions this machine's noise is as large, so the conservative rule).

Ahead mirrors `admission.pacing`'s self-paced judgement (by size: more than one step's chunk
of its own work; by pace: a frame queued behind its own), so the sessions admission leaves
out of its signal are the ones the feed holds back.

Order is kept: pieces leave in the order their input arrived (a late frame's leftover, then
the next frame's input), so the engine writes each session's KV in order; a frame's budget
of new tokens travels with its last piece, so it samples only after all of its input.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from metronome.engine.engine import EngineConfig

ONE_FRAME_TOKENS = 16  # a 1 s audio frame is 12-25 tokens; 16 keeps it on the paged path
LIVE_PERIODS = 2.0  # a session whose last frame arrived this many periods ago may send more


@dataclass(frozen=True)
class FeedPolicy:
    ahead_tokens: int = EngineConfig.max_chunk_tokens  # more queued: ahead (one step's chunk)
    fair_tokens: int = ONE_FRAME_TOKENS  # an ahead session's share while frames are due
    free_engine_tokens: int = EngineConfig.max_chunk_tokens  # ... while none are
    alone_engine_tokens: int = EngineConfig.max_prefill_chunk_tokens  # ... while none is live
    # False: every session's input goes in whole, as before the feed (before/after runs)
    metered: bool = True

    def __post_init__(self) -> None:
        for name in ("ahead_tokens", "fair_tokens", "free_engine_tokens",
                     "alone_engine_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def engine_tokens(self, ahead: bool, contended: bool, alone: bool = False) -> int | None:
        """How much of a session's input the engine may hold now (None: all of it)."""
        if not (ahead and self.metered):
            return None
        if contended:
            return self.fair_tokens
        return self.alone_engine_tokens if alone else self.free_engine_tokens


DEFAULT_FEED = FeedPolicy()


@dataclass
class Piece:
    data: torch.Tensor  # (n,) int64 token ids or (n, hidden) embeddings
    max_new_tokens: int  # the frame's budget, on its last piece only


class SessionFeed:
    """One session's input held back from the engine, and how much the engine holds."""

    def __init__(self) -> None:
        self.held: deque[Piece] = deque()
        self.in_engine_tokens = 0  # handed to the engine, not yet consumed by a step

    @property
    def held_tokens(self) -> int:
        return sum(int(p.data.shape[0]) for p in self.held)

    def hold(self, data: torch.Tensor, max_new_tokens: int) -> None:
        assert int(data.shape[0]) > 0, "an empty frame never reaches the feed"
        self.held.append(Piece(data, max_new_tokens))

    def take(self, limit_tokens: int | None) -> list[Piece]:
        """The pieces to hand over now. None: everything held, as it came. A limit: one
        piece of up to `limit_tokens`, once the engine has consumed the last one (the engine
        takes one piece per step from the head of a session's queue, so pieces handed over
        while one is still there would run as fragments, a step each); it joins what is
        held while the kind of input (ids or embeddings) stays the same, and a budget ends
        it (the frame's last piece)."""
        if limit_tokens is None:
            pieces = list(self.held)
            self.held.clear()
            self.in_engine_tokens += sum(int(p.data.shape[0]) for p in pieces)
            return pieces
        if self.in_engine_tokens > 0 or not self.held:
            return []
        parts, budget, n = [], 0, 0
        while self.held and n < limit_tokens and budget == 0:
            head = self.held[0]
            if parts and not _same_kind(parts[0], head.data):
                break
            size = int(head.data.shape[0])
            if size <= limit_tokens - n:
                parts.append(self.held.popleft().data)
                budget = head.max_new_tokens
            else:
                size = limit_tokens - n
                parts.append(head.data[:size])
                head.data = head.data[size:]
            n += size
        self.in_engine_tokens += n
        return [Piece(parts[0] if len(parts) == 1 else torch.cat(parts), budget)]

    def consumed(self, num_tokens: int) -> None:
        """A step processed `num_tokens` of the session's submitted input."""
        self.in_engine_tokens -= num_tokens
        assert self.in_engine_tokens >= 0, self.in_engine_tokens

    def cancel_generation(self) -> None:
        """The frame was answered early: its held input still goes in, asking for nothing."""
        for piece in self.held:
            piece.max_new_tokens = 0

    def clear(self) -> None:
        self.held.clear()


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two inputs join into one tensor: both token ids, or embeddings alike."""
    return a.dtype == b.dtype and a.shape[1:] == b.shape[1:]
