"""The stall detector: owns the verdict on the *silent* failure, frames on time but empty.

When the KV pool runs dry the engine stops producing tokens, yet the runtime still sends an
empty result on every beat. Latency stays flat and deadlines are met, so latency and
deadline-miss dashboards stay green while users hear silence. This detector looks at output,
not latency: a frame counts as *stalled* when its status is `stalled_kv`, or when it is
`ok` with no output where output was expected (an engine that stalls without saying so).
Nothing else is a KV stall: a `late` frame ran out of time (overload: `deadline_monitor`),
and `rejected`, `cancelled` and `context_full` frames say nothing about the pool, so they
do not enter the window at all. `deadline_met` never makes a frame healthy; it only labels
a stall *silent* (most stalled frames met their deadline, so nothing else will alarm) or
*visible*.

Pure logic, no clock: the verdict is over a `FrameWindow` of all sessions together (one
detector per server): the last `window_frames` frames, and with `window_s` only those that
finished within that many seconds (the server uses its control interval, so a stall, and a
recovery, shows within one interval even when no frame comes). Thresholds, as shares of
stalled frames in the window:

* `degraded_stalled_fraction = 0.05`: a healthy engine stalls on KV only when the pool is
  exhausted, so a sustained rate above zero is already a capacity failure; 5 % (10 of 200
  frames) tolerates an isolated stall at a block boundary of a nearly full pool.
* `critical_stalled_fraction = 0.5`: most frames are empty; this is the cliff itself, where
  the engine stops producing output for every session.
* `min_frames = 20`: no verdict (OK) from fewer frames; one stalled frame out of one is noise.
  (The server's time window holds few frames at low load: it passes a smaller minimum.)
* any session with at least `min_session_frames` frames in the window, every one stalled, is
  at least DEGRADED: one session fully stalled while another holds the pool hides in an
  average of healthy frames.

The verdict is derived from the window on every read, so it returns to OK by itself once the
stalled frames have left the window (no latching, no hysteresis).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable

from metronome.observe.frame_window import FrameWindow, WindowFrame

STALLED_KV_STATUS = "stalled_kv"
# Frames that reached the engine and were answered by it or by their deadline (the values of
# metronome.stream.FrameStatus, spelled out: observe does not import the record).
ENGINE_STATUSES = frozenset({"ok", "late", STALLED_KV_STATUS})


class Health(enum.IntEnum):
    """Also the value of the `metronome_health_state` gauge."""

    OK = 0
    DEGRADED = 1
    CRITICAL = 2


def is_kv_stall(status: str, num_tokens: int, expected_output: bool) -> bool:
    return status == STALLED_KV_STATUS or (status == "ok" and expected_output
                                           and num_tokens == 0)


class StallDetector:
    def __init__(
        self,
        window_frames: int = 200,
        degraded_stalled_fraction: float = 0.05,
        critical_stalled_fraction: float = 0.5,
        min_frames: int = 20,
        window_s: float | None = None,
        min_session_frames: int = 2,
    ) -> None:
        if not 0 < degraded_stalled_fraction <= critical_stalled_fraction <= 1:
            raise ValueError(
                "need 0 < degraded_stalled_fraction <= critical_stalled_fraction <= 1, got "
                f"{degraded_stalled_fraction}, {critical_stalled_fraction}"
            )
        if not 1 <= min_frames <= window_frames or min_session_frames < 1:
            raise ValueError(f"need 1 <= min_frames <= window_frames and min_session_frames "
                             f">= 1, got {min_frames}, {window_frames}, {min_session_frames}")
        self.window_frames = window_frames
        self.degraded_stalled_fraction = degraded_stalled_fraction
        self.critical_stalled_fraction = critical_stalled_fraction
        self.min_frames = min_frames
        self.min_session_frames = min_session_frames
        self.window = FrameWindow(window_frames, window_s)

    def observe(
        self, status: str, num_tokens: int, expected_output: bool, deadline_met: bool,
        at_s: float = 0.0, session_id: Hashable = None,
    ) -> None:
        """Record one finished frame. `status` is a frame status value (`ok`, `stalled_kv`, ...);
        frames that never reached the engine (rejected, cancelled, context_full) are skipped."""
        if status not in ENGINE_STATUSES:
            self.window.advance(at_s)
            return
        stalled = is_kv_stall(status, num_tokens, expected_output)
        self.window.add(WindowFrame(at_s, session_id, stalled, deadline_met))

    def advance(self, now_s: float) -> None:
        """The verdict as of `now_s`: stalls older than the time window no longer count."""
        self.window.advance(now_s)

    @property
    def stalled_fraction(self) -> float:
        """Share of the frames in the window that stalled (0.0 before any frame)."""
        return self.window.bad_fraction

    @property
    def fully_stalled_sessions(self) -> list[tuple[Hashable, int]]:
        return self.window.all_bad_sessions(self.min_session_frames)

    @property
    def state(self) -> Health:
        if len(self.window) < self.min_frames:
            return Health.OK
        if self.stalled_fraction >= self.critical_stalled_fraction:
            return Health.CRITICAL
        if self.stalled_fraction >= self.degraded_stalled_fraction or (
                self.fully_stalled_sessions):
            return Health.DEGRADED
        return Health.OK

    @property
    def reason(self) -> str:
        """One line saying why `state` is what it is, with the numbers behind it."""
        window = self.window
        num_frames = len(window)
        if num_frames < self.min_frames:
            return (f"{num_frames} frames observed, fewer than the {self.min_frames} needed"
                    + self._recovered())
        head = f"{self.stalled_fraction:.0%} of {window.describe()} stalled on KV"
        if window.num_bad == 0:
            return head + self._recovered()
        on_time_fraction = window.num_bad_on_time / window.num_bad
        kind = "silent stall" if on_time_fraction > 0.5 else "visible stall"
        line = f"{head} while {on_time_fraction:.0%} of them met their deadline: {kind}"
        stuck = self.fully_stalled_sessions
        if stuck:
            shown = ", ".join(f"{sid} ({n} frames)" for sid, n in stuck[:4])
            line += f"; every frame stalled for session(s) {shown}"
        return line

    def _recovered(self) -> str:
        last = self.window.last_bad_at_s
        if last is None or self.window.window_s is None:
            return ""
        return f" (recovered: the last stall was {self.window.now_s - last:.1f} s ago)"
