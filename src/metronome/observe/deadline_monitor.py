"""The deadline monitor: owns the verdict on *overload*, frames that miss their deadline.

The stall detector catches the silent failure (on time, empty); this catches the loud one:
the engine cannot keep the beat, frames go out `late` and goodput falls while the pool may
be half empty. A frame counts as *missed* when it reached the engine (`ok` or `late`) and
did not meet its deadline. KV stalls are the stall detector's (they are answered on the
beat); `rejected`, `cancelled` and `context_full` frames say nothing about load.

Frames that were late by their own session's input are no sign of overload: a frame whose
own work (its input plus its session's input still queued ahead of it) exceeds what one
engine step processes for a session (`self_paced_tokens`), or whose session the admission
controller judged to be sending faster than real time (`self_paced_session`, its
`SelfPacing.latest`), is left out, as the controller leaves it out, so one client flooding
its own session does not make the server read "overloaded"; what its flood does to other
sessions shows in their frames. Those frames are kept in a window of their own, so the
reason can say "one session overloads itself" while the verdict stays on the others.

Same window (`FrameWindow`, by count and by age) and thresholds shape as the stall detector:
`degraded_missed_fraction = 0.05` (the admission controller's target leaves 20 % of the
deadline as headroom, so a sustained miss rate is already past capacity) and
`critical_missed_fraction = 0.5` (most frames are late: the beat is lost).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from metronome.observe.frame_window import FrameWindow, WindowFrame
from metronome.observe.stall_detector import Health

TIMED_STATUSES = frozenset({"ok", "late"})


class DeadlineMonitor:
    def __init__(self, window_frames: int = 200, degraded_missed_fraction: float = 0.05,
                 critical_missed_fraction: float = 0.5, min_frames: int = 20,
                 window_s: float | None = None, self_paced_tokens: int | None = None,
                 self_paced_session: Callable[[Hashable], bool] | None = None) -> None:
        if not 0 < degraded_missed_fraction <= critical_missed_fraction <= 1:
            raise ValueError("need 0 < degraded_missed_fraction <= critical_missed_fraction "
                             f"<= 1, got {degraded_missed_fraction}, {critical_missed_fraction}")
        if not 1 <= min_frames <= window_frames:
            raise ValueError(f"need 1 <= min_frames <= window_frames, got {min_frames}")
        self.degraded_missed_fraction = degraded_missed_fraction
        self.critical_missed_fraction = critical_missed_fraction
        self.min_frames = min_frames
        self.self_paced_tokens = self_paced_tokens
        # the verdict on a session's latest frame, asked as each frame is observed (the
        # admission controller's; it must hear of each result first)
        self.self_paced_session = self_paced_session
        # whether the last control interval was steered: the self-paced sessions did the
        # engine's work out of proportion (the admission controller's judgement; it held the
        # cap), so the others' misses are theirs, not the server's load
        self.steered: Callable[[], bool] | None = None
        self.window = FrameWindow(window_frames, window_s)
        self.self_paced = FrameWindow(window_frames, window_s)  # the frames left out
        self.num_self_paced = 0  # frames left out (all time)

    def observe(self, status: str, deadline_met: bool, own_work_tokens: int = 0,
                at_s: float = 0.0, session_id: Hashable = None) -> None:
        frame = WindowFrame(at_s, session_id, not deadline_met, deadline_met)
        if status not in TIMED_STATUSES:
            self.advance(at_s)
        elif self._self_paced(own_work_tokens, session_id):
            self.num_self_paced += 1
            self.window.advance(at_s)
            self.self_paced.add(frame)
        else:
            self.self_paced.advance(at_s)
            self.window.add(frame)

    def _self_paced(self, own_work_tokens: int, session_id: Hashable) -> bool:
        limit, judged = self.self_paced_tokens, self.self_paced_session
        return (limit is not None and own_work_tokens > limit) or (
            judged is not None and judged(session_id))

    def advance(self, now_s: float) -> None:
        self.window.advance(now_s)
        self.self_paced.advance(now_s)

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
            line = f"{len(window)} timed frames observed, fewer than the {self.min_frames} needed"
            return line + self._self_paced_reason()
        line = f"{self.missed_fraction:.0%} of {window.describe()} missed their deadline"
        state = self.state
        if state is not Health.OK and self.steered is not None and self.steered():
            line += (": sessions that flood their own input do most of the engine's work "
                     "(admission holds the cap)")
        elif state is not Health.OK:
            line += ": overload" if state is Health.CRITICAL else ": near capacity"
        return line + self._self_paced_reason()

    def _self_paced_reason(self) -> str:
        """Who is late by their own input, if anyone: not the server's overload."""
        late = sorted((str(sid), t.bad) for sid, t in self.self_paced.by_session.items()
                      if t.bad)
        if not late:
            return ""
        who = ", ".join(f"{sid} ({n} late)" for sid, n in late)
        verdict = ("one session overloads itself" if len(late) == 1
                   else f"{len(late)} sessions overload themselves")
        return (f"; {verdict}, sending input faster than it is served: {who} (left out: no "
                "sign of the server's load)")
