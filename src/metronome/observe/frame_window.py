"""A sliding window of recent frames, by age and by count, with per-session tallies.

Owns only the window: which frames are in it and how many carry the caller's mark (`bad`),
overall and per session. What a mark means and what the counts say is the detectors'
business (`stall_detector`: stalled on KV; `deadline_monitor`: missed its deadline). Time
comes from the caller (`at_s`, `advance(now_s)`), so it runs the same on the virtual and
the wall clock. With `window_s` a frame leaves the window that long after it finished, so
a verdict recovers by itself once the bad frames are old, even when no new frame comes
(an idle server); without it the window is the last `max_frames` frames, whatever their age.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class WindowFrame:
    at_s: float  # when the frame finished
    session_id: Hashable  # None: not told (no per-session tally)
    bad: bool
    on_time: bool  # it met its deadline


@dataclass
class SessionTally:
    frames: int = 0
    bad: int = 0


class FrameWindow:
    def __init__(self, max_frames: int, window_s: float | None = None) -> None:
        if max_frames < 1 or (window_s is not None and window_s <= 0):
            raise ValueError(f"need max_frames >= 1 and window_s > 0 (or None), got "
                             f"max_frames={max_frames}, window_s={window_s}")
        self.max_frames = max_frames
        self.window_s = window_s
        self._frames: deque[WindowFrame] = deque()
        self.num_bad = 0
        self.num_bad_on_time = 0
        self.by_session: dict[Hashable, SessionTally] = {}
        self.last_bad_at_s: float | None = None  # survives the window: "recovered N s ago"
        self.now_s = 0.0  # the latest time seen (a frame's or an advance's)

    def __len__(self) -> int:
        return len(self._frames)

    def add(self, frame: WindowFrame) -> None:
        self.advance(frame.at_s)
        if len(self._frames) == self.max_frames:
            self._count(self._frames.popleft(), -1)
        self._frames.append(frame)
        self._count(frame, 1)
        if frame.bad:
            self.last_bad_at_s = frame.at_s

    def advance(self, now_s: float) -> None:
        """Move the window's end to `now_s`: frames older than `window_s` leave it."""
        self.now_s = max(self.now_s, now_s)
        if self.window_s is None:
            return
        while self._frames and self._frames[0].at_s <= self.now_s - self.window_s:
            self._count(self._frames.popleft(), -1)

    def _count(self, frame: WindowFrame, sign: int) -> None:
        self.num_bad += sign * frame.bad
        self.num_bad_on_time += sign * (frame.bad and frame.on_time)
        tally = self.by_session.setdefault(frame.session_id, SessionTally())
        tally.frames += sign
        tally.bad += sign * frame.bad
        if tally.frames == 0:
            del self.by_session[frame.session_id]
        assert 0 <= self.num_bad_on_time <= self.num_bad <= len(self._frames)

    @property
    def bad_fraction(self) -> float:
        """Share of the frames in the window that are bad (0.0 when it is empty)."""
        return self.num_bad / len(self._frames) if self._frames else 0.0

    def all_bad_sessions(self, min_frames: int) -> list[tuple[Hashable, int]]:
        """(session, frames) of every session with at least `min_frames` frames in the
        window, all of them bad: one session fully stalled hides in a healthy average."""
        return [(sid, t.frames) for sid, t in self.by_session.items()
                if sid is not None and t.frames >= min_frames and t.bad == t.frames]

    def describe(self) -> str:
        """`the last 200 frames` or `the 4 frames of the last 2 s`."""
        if self.window_s is None:
            return f"the last {len(self._frames)} frames"
        return f"the {len(self._frames)} frames of the last {self.window_s:g} s"
