"""The deadline monitor: owns the verdict on *overload*, frames that miss their deadline.

The stall detector catches the silent failure (on time, empty); this catches the loud one:
the engine cannot keep the beat, frames go out `late` and goodput falls while the pool may
be half empty. A frame counts as *missed* when it reached the engine (`ok` or `late`) and
did not meet its deadline. KV stalls are the stall detector's (they are answered on the
beat); `rejected`, `cancelled` and `context_full` frames say nothing about load.

Frames that were late by their own session's input are no sign of overload: a frame whose
own work (its input plus its session's input still queued ahead of it) exceeds what one
engine step processes for a session (`self_paced_tokens`) is left out, as the admission
controller leaves it out, so one client flooding its own session does not make the server
read "overloaded"; what its flood does to other sessions shows in their frames.

Same window (`FrameWindow`, by count and by age) and thresholds shape as the stall detector:
`degraded_missed_fraction = 0.05` (the admission controller's target leaves 20 % of the
deadline as headroom, so a sustained miss rate is already past capacity) and
`critical_missed_fraction = 0.5` (most frames are late: the beat is lost).
"""

from __future__ import annotations

from collections.abc import Hashable

from metronome.observe.frame_window import FrameWindow, WindowFrame
from metronome.observe.stall_detector import Health

TIMED_STATUSES = frozenset({"ok", "late"})


class DeadlineMonitor:
    def __init__(self, window_frames: int = 200, degraded_missed_fraction: float = 0.05,
                 critical_missed_fraction: float = 0.5, min_frames: int = 20,
                 window_s: float | None = None, self_paced_tokens: int | None = None) -> None:
        if not 0 < degraded_missed_fraction <= critical_missed_fraction <= 1:
            raise ValueError("need 0 < degraded_missed_fraction <= critical_missed_fraction "
                             f"<= 1, got {degraded_missed_fraction}, {critical_missed_fraction}")
        if not 1 <= min_frames <= window_frames:
            raise ValueError(f"need 1 <= min_frames <= window_frames, got {min_frames}")
        self.degraded_missed_fraction = degraded_missed_fraction
        self.critical_missed_fraction = critical_missed_fraction
        self.min_frames = min_frames
        self.self_paced_tokens = self_paced_tokens
        self.window = FrameWindow(window_frames, window_s)
        self.num_self_paced = 0  # frames left out (all time)

    def observe(self, status: str, deadline_met: bool, own_work_tokens: int = 0,
                at_s: float = 0.0, session_id: Hashable = None) -> None:
        limit = self.self_paced_tokens
        if status not in TIMED_STATUSES or (limit is not None and own_work_tokens > limit):
            self.num_self_paced += status in TIMED_STATUSES
            self.window.advance(at_s)
            return
        self.window.add(WindowFrame(at_s, session_id, not deadline_met, deadline_met))

    def advance(self, now_s: float) -> None:
        self.window.advance(now_s)

    @property
    def missed_fraction(self) -> float:
        return self.window.bad_fraction

    @property
    def state(self) -> Health:
        if len(self.window) < self.min_frames:
            return Health.OK
        if self.missed_fraction >= self.critical_missed_fraction:
            return Health.CRITICAL
        if self.missed_fraction >= self.degraded_missed_fraction:
            return Health.DEGRADED
        return Health.OK

    @property
    def reason(self) -> str:
        window = self.window
        if len(window) < self.min_frames:
            return f"{len(window)} timed frames observed, fewer than the {self.min_frames} needed"
        line = f"{self.missed_fraction:.0%} of {window.describe()} missed their deadline"
        state = self.state
        if state is Health.OK:
            return line
        return line + (": overload" if state is Health.CRITICAL else ": near capacity")
