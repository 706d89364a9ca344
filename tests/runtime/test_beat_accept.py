"""A frame its submitter accepts before its input is ready (the server's audio on the
encoder thread) counts in the session's record from acceptance on: one count of unanswered
frames and queued input, one check of the bound (at acceptance, not again at submission)."""

from __future__ import annotations

from metronome.engine.engine import Engine, EngineConfig
from metronome.runtime.frame import Frame, FrameResult, FrameStatus
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionProfile
from metronome.sim.cost_model import StepCostModel
from metronome.sim.virtual import VirtualDriver

COST = StepCostModel(fixed_s=0.004, per_token_s=0.0005, per_context_token_s=1e-6)
BOUNDED = SessionProfile(max_output_tokens_per_frame=2, max_queued_input_tokens=8)


def test_an_accepted_frame_counts_from_acceptance_and_is_checked_once(tiny_model):
    engine = Engine(tiny_model, EngineConfig(block_size=16, pool_tokens=4096))
    driver = VirtualDriver(engine, COST, Listeners.of())
    results: list[FrameResult] = []
    beat = driver.beat
    session_id = beat.open_session(BOUNDED, 0.0, None, results.append)
    record = beat.sessions[session_id]

    first, empty = beat.accept(session_id, 6), beat.accept(session_id, 1)
    assert (record.unanswered_frames, record.queued_input_tokens) == (2, 7)
    assert record.fits(1) and not record.fits(2)
    beat.withdraw(empty)  # its input came out empty: no frame
    assert (record.unanswered_frames, record.queued_input_tokens) == (1, 6)

    # 7 tokens where 6 were counted: accepted input is never refused once it arrives
    beat.submit_frame(Frame(session_id, 0, 0.0, token_ids=[5] * 7), 0.0, first)
    assert record.accepted == [] and record.unanswered_frames == 1
    assert record.queued_input_tokens == 7
    beat.submit_frame(Frame(session_id, 1, 0.0, token_ids=[6] * 2), 0.0)  # not accepted first
    assert [(r.index, r.status) for r in results] == [(1, FrameStatus.REJECTED)]
    assert results[0].reason == ("input queue full: 7 tokens of this session's input are not "
                                 "yet processed and this frame adds 2; the limit is 8")

    driver.run_until(1.0)
    assert [(r.index, r.status) for r in results] == [(1, FrameStatus.REJECTED),
                                                      (0, FrameStatus.OK)]
    assert (record.unanswered_frames, record.queued_input_tokens) == (0, 0)
    assert (record.frames_submitted, record.frames_answered) == (2, 2)
