"""The beat withdraws a frame its owner cancels (server VAD's interrupt_response), on the
virtual clock: in flight it is answered `cancelled` with what it had made and the next frame
goes in; waiting, it is answered at once and its input never reaches the engine."""

from __future__ import annotations

from metronome.engine.engine import Engine, EngineConfig
from metronome.runtime.frame import Frame, FrameResult, FrameStatus
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionMode, SessionProfile
from metronome.sim.cost_model import StepCostModel
from metronome.sim.virtual import VirtualDriver

COST = StepCostModel(fixed_s=0.004, per_token_s=0.0005, per_context_token_s=1e-6)
REPLY = SessionProfile(mode=SessionMode.TURN, max_output_tokens_per_frame=64,
                       deadline_fraction=10.0)


def test_a_cancelled_frame_is_answered_at_once_in_flight_or_waiting(tiny_model):
    engine = Engine(tiny_model, EngineConfig(block_size=16, pool_tokens=4096))
    driver = VirtualDriver(engine, COST, Listeners.of())
    results: list[FrameResult] = []
    beat = driver.beat
    session_id = beat.open_session(REPLY, 0.0, None, results.append)
    for index in range(2):  # frame 0 in flight, frame 1 waiting behind it
        beat.submit_frame(Frame(session_id, index, 0.0, token_ids=[5, 6, 7, 8]), 0.0)
    driver.run_until(0.05)  # frame 0 is generating (64 tokens take longer)
    assert results == [] and beat.sessions[session_id].in_flight.token_ids

    assert beat.cancel_frame(session_id, 1, 0.05, "turn_detected")  # waiting: withdrawn
    assert beat.cancel_frame(session_id, 0, 0.05, "turn_detected")  # in flight
    assert [(r.index, r.status, r.reason) for r in results] == [
        (1, FrameStatus.CANCELLED, "turn_detected"), (0, FrameStatus.CANCELLED, "turn_detected")]
    assert results[0].token_ids == [] and 0 < len(results[1].token_ids) < 64
    assert not beat.cancel_frame(session_id, 0, 0.05, "turn_detected")  # answered already
    record = beat.sessions[session_id]
    assert record.in_flight is None and not record.waiting
    assert record.queued_input_tokens == 0  # frame 1's input never went in

    beat.submit_frame(Frame(session_id, 2, 0.1, token_ids=[9, 10]), 0.1)  # the beat goes on
    driver.run_until(5.0)
    assert (results[-1].index, results[-1].status) == (2, FrameStatus.OK)
    assert len(results[-1].token_ids) == 64
