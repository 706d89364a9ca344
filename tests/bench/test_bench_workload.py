"""The one workload runner on the tiny model: the virtual clock (deterministic, every frame
back), a gate that refuses sessions, KV stalls, the wall clock and the FIFO baseline; the one
counting rule of `summary`; and the fresh process a wall-clock run starts in."""

from __future__ import annotations

import os

import pytest

from metronome.admission.controller import AdmissionController
from metronome.admission.limits import make_limit
from metronome.bench.workload import Run, in_fresh_process, run_workload, summary
from metronome.engine.engine import Engine, EngineConfig
from metronome.sim.cost_model import StepCostModel
from metronome.sim.scenario import Scenario
from metronome.sim.workload import Workload
from metronome.stream import Frame, FrameStatus

COST = StepCostModel(fixed_s=0.01, per_token_s=1e-4, per_context_token_s=1e-7)


def run(model, policy="sinks_window:4:32", pool=4096, sessions=3, clock="virtual", **kw):
    sc = Scenario(model, COST, policy=policy)
    return run_workload(Engine(model, EngineConfig(pool_tokens=pool)),
                        Workload(sessions, 5.0, arrival_spread_s=1.0), sc.profile(),
                        sc.source(), clock=clock, cost=COST, **kw)


def test_the_virtual_clock_answers_every_frame_and_repeats_exactly(tiny_model):
    first, again = run(tiny_model), run(tiny_model)
    assert len(first.frames) == 3 * 5 and all(f.status is FrameStatus.OK for f in first.frames)
    assert [(f.session_id, f.index, f.finish_s, f.token_ids) for f in first.frames] == [
        (f.session_id, f.index, f.finish_s, f.token_ids) for f in again.frames]
    assert [f.arrival_s for f in first.frames] == sorted(f.arrival_s for f in first.frames)
    s = summary(first)
    assert (s["frames"], s["never_answered"], s["goodput"], s["stalled_kv"]) == (15, 0, 1.0, 0)
    assert first.overhead["steps"] == len(first.recorder.steps) > 0


def test_unbounded_sessions_in_a_small_pool_stall_and_say_when(tiny_model):
    s = summary(run(tiny_model, policy="unbounded", pool=96))
    assert s["stalled_kv"] > 0 and s["first_stall_s"] is not None and s["goodput"] < 1.0


def test_admission_gates_every_sessions_open(tiny_model):
    seen = []

    def admission(active):
        seen.append(active)
        return AdmissionController(make_limit("static", initial_cap=2), active)

    result = run(tiny_model, sessions=4, admission=admission)
    assert {f.session_id for f in result.frames} == {"s0", "s1"}  # numbered as they open
    assert dict(result.controller.counts) == {"admitted": 2, "refused:at_capacity": 2}
    assert seen[0]() == 0  # the active sessions: the beat's, read when asked


@pytest.mark.parametrize("clock", ["wall", "fifo"])
def test_the_wall_clock_and_the_fifo_baseline_answer_every_frame(tiny_model, clock):
    result = run(tiny_model, sessions=2, clock=clock)
    assert len(result.frames) == 2 * 5 and all(f.status is FrameStatus.OK
                                               for f in result.frames)
    s = summary(result)
    assert s["frames"] == 10 and s["never_answered"] == 0 and s["p50_ms"] > 0
    for sid in ("s0", "s1"):  # a session's frames answered in order
        done = [f.finish_s for f in result.frames if f.session_id == sid]
        assert done == sorted(done)
    if clock == "fifo":
        assert all(f.token_ids for f in result.frames) and not result.recorder.results


def frame(arrival_s: float, status=FrameStatus.OK, latency_s: float = 0.5) -> Frame:
    f = Frame("s0", arrival_s, deadline_at_s=arrival_s + 1.0)
    f.status, f.finish_s = status, (None if status is None else arrival_s + latency_s)
    return f


def test_summary_counts_the_frames_due_by_one_rule():
    frames = [frame(1.0), frame(2.0, latency_s=1.5), frame(3.0, FrameStatus.STALLED_KV),
              frame(4.0, None), frame(9.5)]  # the last: not due (a deadline after the stop)
    s = summary(Run(frames, stopped_s=10.0, deadline_s=1.0))
    assert s["frames"] == 4 and s["never_answered"] == 1 and s["first_unanswered_s"] == 4.0
    assert s["goodput"] == 0.25  # only the first: done within its deadline
    assert s["stalled_kv"] == 1 and s["first_stall_s"] == 3.0
    assert s["p50_ms"] == pytest.approx(500.0) and s["max_ms"] == pytest.approx(1500.0)


def test_a_fresh_process_gets_the_environment_asked_for_and_this_one_keeps_its_own():
    assert in_fresh_process(os.getenv, "METRONOME_BENCH_PROBE", env={
        "METRONOME_BENCH_PROBE": "passed"}) == "passed"
    assert "METRONOME_BENCH_PROBE" not in os.environ
