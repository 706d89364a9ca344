"""A local workload: N sessions arriving over a ramp, each streaming frames on its period.

Everything is put on the driver's timer (`call_at`), so the same workload
runs on the virtual clock and on the wall clock.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from metronome.runtime.beat import Beat
from metronome.runtime.ports import Timer
from metronome.runtime.profile import SessionMode, SessionProfile
from metronome.stream import Frame, Stream

# (session number, frame index) -> (token_ids, embeddings); one of the two is None. Sessions
# are numbered from 0 in the order they open (their stream ids: "s0", "s1", ...).
FrameSource = Callable[[int, int], tuple[list[int] | None, object]]


@dataclass(frozen=True)
class Workload:
    num_sessions: int
    session_duration_s: float
    arrival_spread_s: float = 0.0  # sessions open uniformly at random over [0, spread]
    even_arrivals: bool = False  # open evenly spaced over [0, spread) instead (no collisions)
    duration_jitter: float = 0.0  # each duration x U(1 - jitter, 1 + jitter)
    respond_every_frames: int = 4  # turn mode: every k-th frame ends a user turn
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.session_duration_s <= 0:
            raise ValueError(f"a workload needs >= 1 session and a positive duration, got "
                             f"{self.num_sessions} sessions of {self.session_duration_s} s")
        if not 0 <= self.duration_jitter < 1:
            raise ValueError(f"duration_jitter must be in [0, 1), got {self.duration_jitter}")

    def plan(self) -> list[tuple[float, float]]:
        """(open_at_s, duration_s) per session, from the seed."""
        rng = random.Random(self.seed)
        plans = []
        for k in range(self.num_sessions):
            open_at_s = rng.uniform(0, self.arrival_spread_s)
            if self.even_arrivals:
                open_at_s = k * self.arrival_spread_s / self.num_sessions
            scale = rng.uniform(1 - self.duration_jitter, 1 + self.duration_jitter)
            plans.append((open_at_s, self.session_duration_s * scale))
        return sorted(plans)

    def frame_arrivals_s(self, frame_period_s: float) -> list[list[float]]:
        """When each session's frames arrive (as `schedule` submits them: frame i one period
        after its i-th period began), per session in `plan` order: for a driver that does
        not run on a `Timer` (a bench's own loop) to see the same workload."""
        return [[open_at_s + offset_s for offset_s in frame_offsets_s(duration_s, frame_period_s)]
                for open_at_s, duration_s in self.plan()]

    @property
    def end_s(self) -> float:
        return max(start + duration for start, duration in self.plan())


def frame_offsets_s(duration_s: float, frame_period_s: float) -> list[float]:
    """When a session's frames arrive, from its open: frame i is complete at the server one
    period after it started; a session sends at least one frame."""
    num_frames = max(1, int(duration_s / frame_period_s))
    return [(index + 1) * frame_period_s for index in range(num_frames)]


# now_s -> admitted? (an admission controller's try_admit; refused sessions go away)
Gate = Callable[[float], object]


def schedule(workload: Workload, profile: SessionProfile, beat: Beat, timer: Timer,
             source: FrameSource, gate: Gate | None = None) -> None:
    """Put every session's open, frames and close on the timer."""
    numbers = itertools.count()
    for open_at_s, duration_s in workload.plan():
        timer.call_at(open_at_s, lambda now, d=duration_s: _start(
            workload, profile, beat, timer, source, gate, now, d, numbers))


def _start(workload, profile, beat, timer, source, gate, now_s: float, duration_s: float,
           numbers: itertools.count) -> None:
    if gate is not None and not gate(now_s).admitted:
        return
    number = next(numbers)
    stream = Stream(f"s{number}", profile, now_s)
    beat.add(stream)
    offsets_s = frame_offsets_s(duration_s, profile.frame_period_s)
    for index, offset_s in enumerate(offsets_s):
        timer.call_at(now_s + offset_s, lambda t, i=index: _frame(workload, profile, beat,
                                                                  source, stream, number, i, t))
    end_s = now_s + offsets_s[-1] + profile.frame_period_s
    timer.call_at(end_s, lambda t: beat.close(stream, t))


def _frame(workload, profile, beat, source, stream: Stream, number: int, index: int,
           now_s: float) -> None:
    if beat.streams.get(stream.id) is not stream:
        return
    token_ids, embeddings = source(number, index)
    turn_ends = (index + 1) % workload.respond_every_frames == 0
    respond = profile.mode is SessionMode.DUPLEX or turn_ends
    beat.submit(Frame(stream.id, now_s, respond), now_s, token_ids, embeddings)
