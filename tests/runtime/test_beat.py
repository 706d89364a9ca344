"""The beat driven with a fake engine (`tests/fake_engine.py`: no model) on the virtual
clock: a frame's life from acceptance to its one result, what the stream counts of its
input (one home: every count derived from the stream's offsets), cancels, stalls, the feed
and the attribution of tokens."""

from __future__ import annotations

import pytest
import torch

from metronome.runtime.beat import FeedPolicy
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionMode, SessionProfile
from metronome.sim.cost_model import StepCostModel
from metronome.sim.virtual import VirtualDriver
from metronome.stream import Frame, FrameStatus, Stream
from tests.fake_engine import TOKEN_BASE, FakeEngine
from tests.owner import RecordingOwner

COST = StepCostModel(fixed_s=0.01, per_token_s=0.0, per_context_token_s=0.0)  # 10 ms a step
BOUNDED = SessionProfile(max_output_tokens_per_frame=2, max_queued_input_tokens=8)
REPLY = SessionProfile(mode=SessionMode.TURN, max_output_tokens_per_frame=64,
                       deadline_fraction=10.0)


def start(profile: SessionProfile, chunk_tokens: int = 64, sessions: tuple[str, ...] = ("s",)):
    engine = FakeEngine(chunk_tokens)
    driver = VirtualDriver(engine, COST, Listeners.of())
    owner = RecordingOwner()
    results: list[Frame] = owner.results
    streams = [Stream(sid, profile, owner=owner) for sid in sessions]
    for stream in streams:
        driver.beat.add(stream)
    return engine, driver, results, streams


def test_an_accepted_frame_counts_from_acceptance_and_is_checked_once():
    _, driver, results, [stream] = start(BOUNDED)
    beat = driver.beat
    first, empty = Frame("s", 0.0, input_tokens=6), Frame("s", 0.0, input_tokens=1)
    beat.accept(stream, first)
    beat.accept(stream, empty)
    assert (stream.unanswered_frames, stream.queued_input_tokens) == (2, 7)
    assert stream.fits(1) and not stream.fits(2)
    beat.withdraw(empty)  # its input came out empty: no frame
    assert (stream.unanswered_frames, stream.queued_input_tokens) == (1, 6)

    # 7 tokens where 6 were counted: accepted input is never refused once it arrives
    beat.submit(first, 0.0, token_ids=[5] * 7)
    assert stream.unanswered_frames == 1 and stream.queued_input_tokens == 7
    beat.submit(Frame("s", 0.0), 0.0, token_ids=[6] * 2)  # not accepted first
    assert [(r.index, r.status) for r in results] == [(1, FrameStatus.REJECTED)]
    assert results[0].reason == ("input queue full: 7 tokens of this session's input are not "
                                 "yet processed and this frame adds 2; the limit is 8")

    driver.run_until(1.0)
    assert [(r.index, r.status) for r in results] == [(1, FrameStatus.REJECTED),
                                                      (0, FrameStatus.OK)]
    assert results[1] is first and first.token_ids == [TOKEN_BASE, TOKEN_BASE + 1]
    assert (stream.unanswered_frames, stream.queued_input_tokens) == (0, 0)
    assert (stream.frames_submitted, stream.frames_answered) == (2, 2)


def test_a_cancelled_frame_is_answered_at_once_in_flight_or_waiting():
    engine, driver, results, [stream] = start(REPLY)
    beat = driver.beat
    frames = [Frame("s", 0.0) for _ in range(2)]  # frame 0 in flight, frame 1 waiting
    for frame in frames:
        beat.submit(frame, 0.0, token_ids=[5, 6, 7, 8])
    assert stream.in_flight is frames[0] and stream.received_tokens == 8
    driver.run_until(0.05)  # frame 0 is generating (64 tokens take longer)
    assert results == [] and stream.in_flight.token_ids

    assert beat.cancel(frames[1], 0.05, "turn_detected")  # waiting: withdrawn
    assert beat.cancel(frames[0], 0.05, "turn_detected")  # in flight
    assert [(r.index, r.status, r.reason) for r in results] == [
        (1, FrameStatus.CANCELLED, "turn_detected"), (0, FrameStatus.CANCELLED, "turn_detected")]
    assert results[0].token_ids == [] and 0 < len(results[1].token_ids) < 64
    assert not beat.cancel(frames[0], 0.05, "turn_detected")  # answered already
    assert stream.in_flight is None and not stream.frames
    assert stream.queued_input_tokens == 0 and stream.received_tokens == 4  # frame 1's went
    assert engine.sessions["s"].budget == 0  # the reply's generation was cancelled

    beat.submit(Frame("s", 0.1), 0.1, token_ids=[9, 10])  # the beat goes on
    driver.run_until(5.0)
    assert (results[-1].index, results[-1].status) == (2, FrameStatus.OK)
    assert len(results[-1].token_ids) == 64
    assert engine.fed("s").tolist() == [5, 6, 7, 8, 9, 10]  # frame 1's input never went in


def test_a_frame_cancelled_while_it_is_prepared_is_answered_once_it_arrives():
    _, driver, results, [stream] = start(REPLY)
    frame = Frame("s", 0.0, kind="response", input_tokens=3)
    driver.beat.accept(stream, frame)
    assert driver.beat.cancel(frame, 0.0, "client_cancelled")  # still being prepared
    assert results == []
    driver.beat.submit(frame, 0.0, token_ids=[1, 2, 3])
    assert [(r.index, r.status, r.reason) for r in results] == [
        (0, FrameStatus.CANCELLED, "client_cancelled")]


def test_a_held_session_answers_every_frame_cancelled_feeds_nothing_and_loses_no_input():
    engine, driver, results, [stream] = start(REPLY, chunk_tokens=2)
    beat = driver.beat
    frames = [Frame("s", 0.0) for _ in range(2)]  # frame 0 in flight, frame 1 waiting
    for frame in frames:
        beat.submit(frame, 0.0, token_ids=[5, 6, 7, 8])
    waiting_reply = Frame("s", 0.0, respond=True, kind="response")
    beat.submit(waiting_reply, 0.0, token_ids=[77, 78])  # withdrawn at the hold
    driver.run_until(0.015)  # one step: frame 0's first chunk
    prepared = Frame("s", 0.02, input_tokens=2)
    beat.accept(stream, prepared)  # its input still being prepared
    beat.hold(stream, 0.02, "away")
    assert [(r.index, r.status, r.reason) for r in results] == [
        (2, FrameStatus.CANCELLED, "away"), (0, FrameStatus.CANCELLED, "away"),
        (1, FrameStatus.CANCELLED, "away")]
    fed = len(engine.fed("s"))
    driver.run_until(2.0)  # nothing more is fed while held, whatever the clock
    assert len(engine.fed("s")) == fed < 8
    beat.submit(prepared, 2.0, token_ids=[9, 10])  # arrives while held: answered at once
    assert (results[-1].index, results[-1].status) == (3, FrameStatus.CANCELLED)
    assert stream.queued_input_tokens == 10 - fed  # kept, in the stream

    reply = Frame("s", 2.0, respond=True, kind="response")
    beat.submit(reply, 2.0, token_ids=[99])  # a reply asked for while held: withdrawn
    assert (results[-1].index, results[-1].status) == (4, FrameStatus.CANCELLED)
    assert stream.queued_input_tokens == 10 - fed

    beat.release(stream, 2.0)
    beat.submit(Frame("s", 2.0), 2.0, token_ids=[11])
    driver.run_until(10.0)
    assert (results[-1].index, results[-1].status) == (5, FrameStatus.OK)
    assert engine.fed("s").tolist() == [5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 11]  # the user's
    # input all went in; the withdrawn replies' prompts never did


def test_a_late_frames_input_stays_and_its_late_tokens_are_its_own():
    # a 55 ms deadline against 10 ms steps of 8 tokens: 32 tokens of input take 40 ms, then
    # 4 tokens of output take 30 ms more
    profile = SessionProfile(frame_period_s=0.1, deadline_fraction=0.55,
                             max_output_tokens_per_frame=4)
    engine, driver, results, [stream] = start(profile, chunk_tokens=8)
    first = Frame("s", 0.0)
    driver.beat.submit(first, 0.0, token_ids=list(range(1, 33)))
    driver.run_until(0.075)
    assert (first.status, first.reason) == (FrameStatus.LATE, "deadline passed mid-work")
    assert first.token_ids == [TOKEN_BASE, TOKEN_BASE + 1] and not first.deadline_met
    assert first.late_token_ids == [TOKEN_BASE + 2]  # the step under way at the deadline
    second = Frame("s", 0.1)
    driver.beat.submit(second, 0.1, token_ids=[40, 41])
    assert second.queued_ahead_tokens == 0  # the first's input is all consumed by now
    driver.run_until(1.0)
    assert second.status is FrameStatus.OK and second.token_ids
    assert engine.fed("s").tolist() == list(range(1, 33)) + [40, 41]  # nothing dropped
    assert stream.consumed_tokens == stream.received_tokens == 34


def test_a_frame_prepared_past_its_deadline_is_answered_late_saying_so():
    """An encoder behind (the server's Whisper or front end): the frame is never dropped, its
    input still reaches the engine, and its result says why it is late."""
    profile = SessionProfile(frame_period_s=0.1, deadline_fraction=1.0)
    engine, driver, results, [stream] = start(profile)
    frame = Frame("s", 0.0, input_tokens=2)
    driver.beat.accept(stream, frame)
    driver.run_until(0.3)  # its input is still being prepared at its deadline (0.1 s)
    assert frame.status is None
    driver.beat.submit(frame, 0.3, token_ids=[7, 8])
    driver.run_until(1.0)
    assert (frame.status, frame.reason) == (
        FrameStatus.LATE, "deadline passed while its input was prepared (the encoder behind)")
    assert engine.fed("s").tolist() == [7, 8]  # nothing dropped


def test_a_backlog_is_paid_before_the_next_frame_and_counted_ahead_of_it():
    profile = SessionProfile(frame_period_s=0.1, deadline_fraction=0.25,
                             max_output_tokens_per_frame=1)
    engine, driver, results, [stream] = start(profile, chunk_tokens=8)
    driver.beat.submit(Frame("s", 0.0), 0.0, token_ids=list(range(1, 41)))  # 5 steps of input
    driver.run_until(0.025)  # answered late after 2 steps: 24 tokens still queued
    assert results[0].status is FrameStatus.LATE and results[0].token_ids == []
    assert stream.backlog_tokens == 24
    second = Frame("s", 0.025)
    driver.beat.submit(second, 0.025, token_ids=[7, 8])
    assert second.queued_ahead_tokens == 24 and second.own_work_tokens == 26
    driver.run_until(1.0)  # the backlog takes the second's 25 ms: it is late, unstarted
    assert (second.status, second.start_s) == (FrameStatus.LATE, None)
    assert stream.backlog_tokens == 0 and stream.consumed_tokens == 42
    assert engine.fed("s").tolist() == list(range(1, 41)) + [7, 8]


def test_a_session_stalled_on_kv_is_answered_at_once_and_its_input_kept():
    engine, driver, results, [stream] = start(SessionProfile(max_output_tokens_per_frame=2))
    engine.stalled.add("s")
    driver.beat.submit(Frame("s", 0.0), 0.0, token_ids=[1, 2, 3])
    driver.run_until(0.5)
    assert [(r.status, r.reason, r.token_ids) for r in results] == [
        (FrameStatus.STALLED_KV, "no free KV block", [])]
    assert results[0].deadline_met  # on time, and empty: the silent cliff, made visible
    engine.stalled.clear()
    driver.beat.submit(Frame("s", 0.6), 0.6, token_ids=[4])
    driver.run_until(2.0)
    assert results[-1].status is FrameStatus.OK
    assert engine.fed("s").tolist() == [1, 2, 3, 4]


def test_an_ended_session_answers_what_is_owed_and_refuses_the_rest():
    engine, driver, results, [stream] = start(SessionProfile(max_output_tokens_per_frame=2))
    engine.ended.add("s")
    driver.beat.submit(Frame("s", 0.0), 0.0, token_ids=[1, 2])
    driver.beat.submit(Frame("s", 0.0), 0.0, token_ids=[3])  # waiting behind it
    driver.run_until(0.5)
    assert [(r.index, r.status) for r in results] == [(0, FrameStatus.CONTEXT_FULL),
                                                      (1, FrameStatus.REJECTED)]
    driver.beat.submit(Frame("s", 0.6), 0.6, token_ids=[4])
    assert (results[-1].status, results[-1].reason) == (FrameStatus.REJECTED,
                                                       "max_session_tokens reached")
    assert stream.frames_answered == stream.frames_submitted == 3


def test_bad_input_is_rejected_with_the_reason_and_nothing_else_changes():
    _, driver, results, [stream] = start(SessionProfile())
    driver.beat.submit(Frame("s", 0.0), 0.0, token_ids=[-1])
    driver.beat.submit(Frame("s", 0.0), 0.0, token_ids=[])
    driver.beat.submit(Frame("s", 0.0), 0.0, embeddings=torch.zeros(2, 3))
    assert [r.status for r in results] == [FrameStatus.REJECTED] * 3
    assert results[0].reason.startswith("token ids must be in [0, 1000)")
    assert results[1].reason == "empty frame"
    assert results[2].reason == "embeddings must be (n, 8)"
    assert stream.received_tokens == 0 and not stream.frames


def test_closing_answers_what_is_owed_and_closes_the_engine_session():
    engine, driver, results, [stream] = start(REPLY)
    for _ in range(2):
        driver.beat.submit(Frame("s", 0.0), 0.0, token_ids=[1, 2])
    driver.beat.close(stream, 0.0)
    assert [(r.index, r.status, r.reason) for r in results] == [
        (0, FrameStatus.CANCELLED, "session closed"), (1, FrameStatus.CANCELLED,
                                                       "session closed")]
    assert engine.closed == ["s"] and "s" not in driver.beat.streams


def test_the_feed_gives_an_ahead_session_a_frames_share_while_others_are_due():
    policy = FeedPolicy(ahead_tokens=16, fair_tokens=4, free_engine_tokens=16,
                        alone_engine_tokens=32)
    profile = SessionProfile(frame_period_s=0.1, max_output_tokens_per_frame=1)
    engine, driver, _, _ = start(profile, sessions=("calm", "flood"))
    driver.beat.feed_policy = policy
    driver.beat.submit(Frame("calm", 0.0), 0.0, token_ids=[1, 2, 3])
    driver.beat.submit(Frame("flood", 0.0), 0.0, token_ids=list(range(1, 401)))
    # the calm frame is due: its own input whole, the flood one frame's share
    assert engine.sessions["calm"].fed_log == [(3, 1)]
    assert engine.sessions["flood"].fed_log == [(4, 0)]
    driver.run_until(0.15)  # the calm session is answered, still live: a chunk a step
    assert {n for n, _ in engine.sessions["flood"].fed_log[1:]} == {16}
    driver.run_until(2.0)  # two periods quiet: the flood is alone, at prefill chunks
    log = engine.sessions["flood"].fed_log
    assert max(n for n, _ in log) == 32 and sum(n for n, _ in log) == 400
    # answered late long before its input's end: its budget never went to the engine
    assert {budget for _, budget in log} == {0}
    assert engine.fed("flood").tolist() == list(range(1, 401))  # whole and in order


def test_a_limited_piece_stops_where_the_input_changes_kind():
    engine, driver, _, [stream] = start(SessionProfile(max_output_tokens_per_frame=1))
    driver.beat.feed_policy = FeedPolicy(ahead_tokens=1, fair_tokens=16, free_engine_tokens=16,
                                         alone_engine_tokens=16)
    stream.append(torch.arange(3))  # an answered frame's leftover ids, then embeddings
    driver.beat.submit(Frame("s", 0.0), 0.0, embeddings=torch.zeros(2, 8))
    assert engine.sessions["s"].fed_log == [(3, 0)]  # ahead: ids alone first
    driver.run_until(0.5)
    assert engine.sessions["s"].fed_log == [(3, 0), (2, 1)]


def test_policy_limits():
    policy = FeedPolicy(ahead_tokens=64, fair_tokens=16, free_engine_tokens=64)
    assert policy.engine_tokens(ahead=False, contended=True) is None
    assert policy.engine_tokens(ahead=True, contended=True) == 16
    assert policy.engine_tokens(ahead=True, contended=False) == 64
    assert policy.engine_tokens(ahead=True, contended=False, alone=True) == 256
    assert policy.engine_tokens(ahead=True, contended=True, alone=True) == 16
    assert FeedPolicy(metered=False).engine_tokens(ahead=True, contended=True) is None
    with pytest.raises(ValueError):
        FeedPolicy(fair_tokens=0)


def test_context_joins_the_stream_with_no_frame_counted_at_its_most_until_it_arrives():
    """A turn session's text items are context: no frame, no deadline, no answer; counted at
    the most they can make while prepared, at what they made once appended, and fed in
    order with the frames around them (nothing dropped)."""
    profile = SessionProfile(mode=SessionMode.TURN, frame_period_s=0.1,
                             max_queued_input_tokens=100)
    engine, driver, results, [stream] = start(profile, chunk_tokens=8)
    beat = driver.beat
    beat.accept_context(stream, 30)
    beat.accept_context(stream, 30)
    assert (stream.queued_input_tokens, stream.unanswered_frames) == (60, 0)
    assert stream.fits(40) and not stream.fits(41)
    check_input, seen = engine.check_input, []

    def checking(token_ids, embeddings):  # another thread may read the count meanwhile
        seen.append(stream.queued_input_tokens)
        return check_input(token_ids, embeddings)

    engine.check_input = checking
    assert beat.append_context(stream, 30, torch.tensor([1, 2, 3]), 0.0) == ""
    assert seen == [60]  # the reservation held until the context was in the stream
    assert beat.append_context(stream, 30, None, 0.0) == ""  # withdrawn: its count goes
    assert (stream.queued_input_tokens, stream.context_until) == (3, 3)
    assert stream.context_pending
    driver.run_until(1.0)
    assert results == [] and not stream.context_pending
    assert engine.fed("s").tolist() == [1, 2, 3] and stream.consumed_tokens == 3

    beat.accept_context(stream, 5)
    assert beat.append_context(stream, 5, torch.tensor([10 ** 9]), 1.0) != ""  # not a token
    assert stream.queued_input_tokens == 0 and stream.received_tokens == 3


def test_a_frame_behind_its_sessions_context_is_due_once_the_context_is_in():
    """A reply asked for right after a burst of history: its deadline counts from when the
    history is in the KV (the burst is the client's own load), so it is answered whole; a
    frame submitted with no context ahead keeps its own deadline, and is never due before a
    frame ahead of it."""
    profile = SessionProfile(mode=SessionMode.TURN, frame_period_s=0.1, deadline_fraction=1.0,
                             max_output_tokens_per_frame=2)
    engine, driver, results, [stream] = start(profile, chunk_tokens=8)
    beat = driver.beat
    beat.accept_context(stream, 80)
    beat.append_context(stream, 80, torch.arange(1, 81), 0.0)  # 10 steps of 10 ms
    reply = Frame("s", 0.0, respond=True, kind="response")
    beat.submit(reply, 0.0, token_ids=[5])
    assert reply.behind_context_until == 80 and reply.deadline_at_s == pytest.approx(0.1)
    after = Frame("s", 0.05, respond=False, kind="audio")  # sent while the history is queued
    beat.submit(after, 0.05, token_ids=[6])
    driver.run_until(2.0)
    assert [(r.status, len(r.token_ids)) for r in results] == [(FrameStatus.OK, 2),
                                                               (FrameStatus.OK, 0)]
    assert reply.deadline_at_s > 0.19 and reply.deadline_met  # the history took ~0.1 s
    assert after.deadline_at_s >= reply.deadline_at_s
    assert engine.fed("s").tolist() == list(range(1, 81)) + [5, 6]

    late = Frame("s", 2.0, respond=True, kind="response")  # no context ahead: its own deadline
    beat.submit(late, 2.0, token_ids=list(range(1, 161)))  # 20 steps: past its 0.1 s
    driver.run_until(3.0)
    assert late.behind_context_until is None and late.status is FrameStatus.LATE
    assert late.deadline_at_s == pytest.approx(2.1)


def test_a_reply_withdrawn_behind_context_leaves_no_prompt_in_the_kv():
    """A reply in flight behind context is fed only once the context is in: cancelled (or
    held) before that, it leaves with its prompt, as a waiting reply does."""
    profile = SessionProfile(mode=SessionMode.TURN, frame_period_s=0.1, deadline_fraction=1.0,
                             max_output_tokens_per_frame=2)
    engine, driver, results, [stream] = start(profile, chunk_tokens=8)
    beat = driver.beat
    beat.accept_context(stream, 40)
    beat.append_context(stream, 40, torch.arange(1, 41), 0.0)
    reply = Frame("s", 0.0, respond=True, kind="response")
    beat.submit(reply, 0.0, token_ids=[5, 6])
    assert stream.in_flight is reply and stream.feedable_until == 40
    driver.run_until(0.02)
    assert beat.cancel(reply, 0.02, "turn_detected")
    assert (reply.status, reply.token_ids) == (FrameStatus.CANCELLED, [])
    driver.run_until(1.0)
    assert engine.fed("s").tolist() == list(range(1, 41))  # the context only
    assert stream.received_tokens == stream.consumed_tokens == 40


def test_a_paced_reply_is_due_at_its_first_output_and_never_cut():
    """A turn's reply is an output stream: due at its first output, then as long as its own
    budget (not the profile's), however long that takes; the same frame unpaced is cut at
    its deadline with what was ready."""
    profile = SessionProfile(mode=SessionMode.TURN, frame_period_s=0.1, deadline_fraction=1.0,
                             max_output_tokens_per_frame=4)
    engine, driver, results, [stream] = start(profile, chunk_tokens=8)
    beat = driver.beat
    paced = Frame("s", 0.0, respond=True, kind="response", output_budget_tokens=40,
                  paced=True)
    beat.submit(paced, 0.0, token_ids=[5])
    driver.run_until(5.0)
    [answer] = results
    assert answer.status is FrameStatus.OK and len(answer.token_ids) == 40  # its own budget
    assert answer.finish_s > answer.deadline_at_s  # ran past its deadline, whole
    assert answer.first_output_s is not None and answer.first_output_s < answer.deadline_at_s
    assert answer.deadline_met and answer.good
    assert answer.latency_s == pytest.approx(answer.first_output_s - answer.arrival_s)

    cut = Frame("s", 5.0, respond=True, kind="response", output_budget_tokens=40)
    beat.submit(cut, 5.0, token_ids=[6])
    driver.run_until(10.0)
    assert results[1].status is FrameStatus.LATE and 0 < len(results[1].token_ids) < 40
