"""The beat on the wall clock with the real bundled SmolLM2: deadlines met, latency grows
with load. Numbers go to the test log (-s) and, measured properly, to docs/results/runtime.md."""

from __future__ import annotations

import pytest

from metronome.sim.local import RunConfig, run_local

pytestmark = pytest.mark.wall_clock

# 1 vs 8 vs 48: with the paged kernel a decode step of 4 sessions costs what one of 1 does
# (the weights' reads dominate), so 1 vs 4 left p50 within noise (488 vs 483 ms measured)
SESSIONS = (1, 8, 48)
# (sessions, repeat), as runs' keys: every load once, then the light loads again
ORDER = [(n, 0) for n in SESSIONS] + [(n, 1) for n in SESSIONS[:2]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each load's run, in the order 1, 8, 48, then 1 and 8 again: the keys are (sessions,
    repeat). A shared host can be several times slower for a while (one CI run measured p50
    729 ms for 1 session and 1,183 ms for 8 while it was, then 400 ms for 48 once it was not),
    so the light loads are measured on both sides of the heavy one and compared by their
    better run."""
    out = {}
    # Sessions spread wide enough that the latency steps stand out of the noise. The frame
    # period is sized to the machine: one session's latency at 1 s frames is measured first,
    # and the period is at least 6x it, so that 8 sessions are a small load anywhere (a
    # 2-core AMD EPYC in fp32 answers one session in ~0.25 s; CI machines have been 4x
    # slower than that). The frames' deadline is the period.
    period_s = 1.0
    for sessions, repeat in ORDER:
        config = RunConfig(sessions=sessions, duration_s=8.0 * period_s, ramp_s=period_s,
                           frame_period_s=period_s, tokens_per_frame=12, output_tokens=4,
                           policy="sinks_window:4:64", clock="wall",
                           out=str(tmp_path_factory.mktemp(f"n{sessions}r{repeat}")))
        out[sessions, repeat] = run_local(config)
        if (sessions, repeat) == (1, 0):
            one_ms = out[1, 0]["latency_ms"]["p50"]
            period_s = max(1.0, round(6 * one_ms / 1e3, 1))
            print(f"one session: p50 {one_ms:.0f} ms -> period {period_s} s")
    return out


def test_small_load_meets_every_deadline(runs):
    for sessions in SESSIONS[:2]:
        light = [runs[key] for key in runs if key[0] == sessions]
        assert all(summary["frames"] == sessions * 8 for summary in light)  # 8 periods each
        # one of its two runs, as above: a slow spell of the host is not the engine's miss
        best = max(light, key=lambda summary: summary["deadline_met_fraction"])
        assert best["deadline_met_fraction"] == 1.0, [s["frames_by_status"] for s in light]
        assert best["goodput"] == 1.0


def test_latency_rises_with_sessions(runs):
    by_run = {key: runs[key]["latency_ms"]["p50"] for key in runs}
    print("wall clock p50 latency ms by (sessions, repeat):", by_run)
    p50 = {n: min(v for (s, _), v in by_run.items() if s == n) for n in SESSIONS}
    low, mid, high = SESSIONS
    # 1 vs 8 is not asserted: a decode step of 8 rows costs about what one of 1 does, and 8
    # frames of one session are few (CI measured 100 ms for 1 and 83 ms for 8). 48 sessions
    # collide in steps and queue: measured 1.93x the larger of the two (24 sessions were
    # 1.38-1.77x until the engine thread took the GIL back every 0.5 ms, then 1.11x).
    assert p50[high] > 1.15 * max(p50[low], p50[mid]), by_run


def test_a_failing_engine_step_is_reported_and_the_thread_keeps_serving(tiny_model):
    import asyncio

    from metronome.engine.engine import Engine, EngineConfig
    from metronome.runtime.ports import Listeners
    from metronome.runtime.profile import SessionProfile
    from metronome.runtime.wall import WallDriver
    from metronome.stream import Frame, Stream

    engine = Engine(tiny_model, EngineConfig(block_size=16, pool_tokens=1024))
    real_step, calls = engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_step()

    engine.step = failing_once
    results = []

    async def scenario():
        driver = WallDriver(engine, Listeners(on_result=results.append))
        stream = Stream("s", SessionProfile(frame_period_s=0.5))
        driver.beat.add(stream)
        driver.beat.submit(Frame("s", driver.now_s()), driver.now_s(), [1, 2, 3])
        await asyncio.sleep(0.3)
        driver.beat.submit(Frame("s", driver.now_s()), driver.now_s(), [4, 5])
        await asyncio.sleep(0.8)
        driver.beat.close(stream, driver.now_s())
        await asyncio.sleep(0.2)
        driver.close()
        return driver.error

    error = asyncio.run(scenario())
    assert error == "RuntimeError: boom"
    assert len(calls) > 1 and len(results) == 2  # the engine kept stepping after the failure
    assert engine.pool_stats().used_blocks == 0  # and the close still returned every block
