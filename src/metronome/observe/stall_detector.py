"""The stall detector: owns the verdict on the *silent* failure, frames on time but empty.

When the KV pool runs dry the engine stops producing tokens, yet the runtime still sends an
empty result on every beat. Latency stays flat and deadlines are met, so latency and
deadline-miss dashboards stay green while users hear silence. This detector looks at output,
not latency: a frame counts as *stalled* when its status is `stalled_kv` or when output was
expected and none came. `deadline_met` never makes a frame healthy; it only labels a stall
*silent* (most stalled frames met their deadline, so nothing else will alarm) or *visible*.

Pure logic, no clock: the verdict is over the last `window_frames` frames of all sessions
together (one detector per server). Thresholds, as shares of stalled frames in the window:

* `degraded_stalled_fraction = 0.05`: a healthy engine stalls on KV only when the pool is
  exhausted, so a sustained rate above zero is already a capacity failure; 5 % (10 of 200
  frames) tolerates an isolated stall at a block boundary of a nearly full pool.
* `critical_stalled_fraction = 0.5`: most frames are empty; this is the cliff itself, where
  the engine stops producing output for every session.
* `min_frames = 20`: no verdict (OK) from fewer frames; one stalled frame out of one is noise.

The verdict is derived from the window on every read, so it returns to OK by itself once the
stalled frames have left the window (no latching, no hysteresis).
"""

from __future__ import annotations

import enum
from collections import deque

STALLED_KV_STATUS = "stalled_kv"


class Health(enum.IntEnum):
    """Also the value of the `metronome_health_state` gauge."""

    OK = 0
    DEGRADED = 1
    CRITICAL = 2


class StallDetector:
    def __init__(
        self,
        window_frames: int = 200,
        degraded_stalled_fraction: float = 0.05,
        critical_stalled_fraction: float = 0.5,
        min_frames: int = 20,
    ) -> None:
        if not 0 < degraded_stalled_fraction <= critical_stalled_fraction <= 1:
            raise ValueError(
                "need 0 < degraded_stalled_fraction <= critical_stalled_fraction <= 1, got "
                f"{degraded_stalled_fraction}, {critical_stalled_fraction}"
            )
        if not 1 <= min_frames <= window_frames:
            raise ValueError(f"need 1 <= min_frames <= window_frames, got {min_frames}")
        self.window_frames = window_frames
        self.degraded_stalled_fraction = degraded_stalled_fraction
        self.critical_stalled_fraction = critical_stalled_fraction
        self.min_frames = min_frames
        # (stalled, deadline_met) per frame, oldest first; counts kept in step with the window
        self._frames: deque[tuple[bool, bool]] = deque()
        self._num_stalled = 0
        self._num_stalled_on_time = 0

    def observe(
        self, status: str, num_tokens: int, expected_output: bool, deadline_met: bool
    ) -> None:
        """Record one finished frame. `status` is a frame status value (`ok`, `stalled_kv`, ...)."""
        stalled = status == STALLED_KV_STATUS or (expected_output and num_tokens == 0)
        if len(self._frames) == self.window_frames:
            self._count(*self._frames.popleft(), sign=-1)
        self._frames.append((stalled, deadline_met))
        self._count(stalled, deadline_met, sign=1)

    def _count(self, stalled: bool, deadline_met: bool, sign: int) -> None:
        self._num_stalled += sign * stalled
        self._num_stalled_on_time += sign * (stalled and deadline_met)

    @property
    def stalled_fraction(self) -> float:
        """Share of the frames in the window that stalled (0.0 before any frame)."""
        return self._num_stalled / len(self._frames) if self._frames else 0.0

    @property
    def state(self) -> Health:
        if len(self._frames) < self.min_frames:
            return Health.OK
        if self.stalled_fraction >= self.critical_stalled_fraction:
            return Health.CRITICAL
        if self.stalled_fraction >= self.degraded_stalled_fraction:
            return Health.DEGRADED
        return Health.OK

    @property
    def reason(self) -> str:
        """One line saying why `state` is what it is, with the numbers behind it."""
        num_frames = len(self._frames)
        if num_frames < self.min_frames:
            return f"{num_frames} frames observed, fewer than the {self.min_frames} needed"
        head = (
            f"{self.stalled_fraction:.0%} of the last {num_frames} frames stalled on KV"
        )
        if self._num_stalled == 0:
            return head
        on_time_fraction = self._num_stalled_on_time / self._num_stalled
        kind = "silent stall" if on_time_fraction > 0.5 else "visible stall"
        return f"{head} while {on_time_fraction:.0%} of them met their deadline: {kind}"
