"""The workload's plan: seeded phases or evenly spaced ones, and the frame arrival times a
bench's own loop reads (`frame_arrivals_s`) are the times `schedule` submits frames at."""

from __future__ import annotations

from metronome.runtime.profile import SessionProfile
from metronome.sim.workload import Workload, schedule


class _Timer:
    def __init__(self) -> None:
        self.calls: list = []

    def call_at(self, at_s, callback) -> None:
        self.calls.append((at_s, callback))

    def run(self) -> None:
        while self.calls:
            self.calls.sort(key=lambda c: c[0])
            at_s, callback = self.calls.pop(0)
            callback(at_s)


class _Beat:
    """Opens sessions in order and notes when each frame is submitted."""

    def __init__(self) -> None:
        self.streams: dict[str, object] = {}
        self.submitted: dict[str, list[float]] = {}

    def add(self, stream) -> None:
        self.streams[stream.id] = stream
        self.submitted[stream.id] = []

    def submit(self, frame, now_s, token_ids=None, embeddings=None) -> None:
        self.submitted[frame.session_id].append(now_s)

    def close(self, stream, now_s) -> None:
        pass


def test_even_arrivals_are_evenly_spaced_and_random_ones_seeded():
    even = Workload(8, 10.0, arrival_spread_s=1.0, even_arrivals=True).plan()
    assert [round(t, 6) for t, _ in even] == [k / 8 for k in range(8)]
    random_a = Workload(8, 10.0, arrival_spread_s=1.0, seed=4).plan()
    assert random_a == Workload(8, 10.0, arrival_spread_s=1.0, seed=4).plan()
    assert random_a != Workload(8, 10.0, arrival_spread_s=1.0, seed=5).plan()
    assert all(0 <= t <= 1.0 for t, _ in random_a)


def test_frame_arrivals_are_when_schedule_submits_frames():
    profile = SessionProfile(frame_period_s=0.5)
    for even in (False, True):
        workload = Workload(5, 3.2, arrival_spread_s=0.5, even_arrivals=even, seed=2)
        timer, beat = _Timer(), _Beat()
        schedule(workload, profile, beat, timer, lambda sid, index: ([1, 2], None))
        timer.run()
        submitted = [beat.submitted[f"s{k}"] for k in range(5)]
        assert submitted == workload.frame_arrivals_s(0.5)
        assert all(len(times) == 6 for times in submitted)  # int(3.2 / 0.5) frames each
