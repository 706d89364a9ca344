"""Who is behind (`serve.realtime.intake`): audio past the buffer bound is refused only to a
client ahead of real time, with a message that says so; a client sending at real time while
the server falls behind has its audio kept (up to `max_behind_audio_s`, then `server_behind`)
and the session is told. A fake session and stream; no model, no socket."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.realtime.intake import MAX_CATCH_UP_S, Intake, RealTimePace

RATE_BYTES_PER_S = 48000  # PCM16 at 24 kHz


class Owner:
    closed = False

    def __init__(self) -> None:
        self.behind: list[tuple[float, bool]] = []

    def input_behind(self, unanswered_s: float, ahead_s: float, first: bool) -> None:
        self.behind.append((unanswered_s, first))


class Stream:
    def __init__(self, unanswered: list[int]) -> None:
        self._unanswered = unanswered

    @property
    def unanswered_frames(self) -> int:
        return self._unanswered[0]

    def fits(self, num_tokens: int) -> bool:
        return True


def _intake(owner: Owner, clock: list[float], unanswered: list[int]) -> Intake:
    return Intake(owner, None, None, lambda: clock[0],  # type: ignore[arg-type]
                  Stream(unanswered),  # type: ignore[arg-type]
                  frame_period_s=1.0, max_buffered_audio_s=4.0, max_text_chars=100,
                  max_behind_audio_s=8.0)


FRAMER = SimpleNamespace(pending_bytes=0, bytes_per_s=RATE_BYTES_PER_S, tokens=lambda n: 1)


def test_real_time_audio_past_the_bound_is_kept_and_told_once_a_stretch():
    owner, clock, unanswered = Owner(), [0.0], [0]
    intake = _intake(owner, clock, unanswered)
    for second in range(8):  # 1 s chunks at real time; the server answers none of them
        clock[0], unanswered[0] = float(second), second
        intake.check_audio_room(FRAMER, RATE_BYTES_PER_S)  # never refused
    assert [first for _, first in owner.behind] == [True, False, False, False]  # 5..8 s
    unanswered[0], clock[0] = 1, 8.0  # it caught up
    intake.check_audio_room(FRAMER, RATE_BYTES_PER_S)
    unanswered[0], clock[0] = 6, 9.0  # behind again: a new stretch, told again
    intake.check_audio_room(FRAMER, RATE_BYTES_PER_S)
    assert owner.behind[-1] == (7.0, True)
    unanswered[0], clock[0] = 8, 10.0  # past what is kept for it: refused, the server named
    with pytest.raises(ClientError) as refused:
        intake.check_audio_room(FRAMER, RATE_BYTES_PER_S)
    assert refused.value.code is ErrorCode.SERVER_BEHIND
    assert "the server is behind" in str(refused.value) and "not your client" in str(
        refused.value)


def test_audio_ahead_of_real_time_past_the_bound_is_refused_as_such():
    owner, clock, unanswered = Owner(), [0.0], [0]
    intake = _intake(owner, clock, unanswered)
    with pytest.raises(ClientError) as refused:
        for k in range(8):  # 1 s chunks every 0.2 s: 5x real time, none answered
            clock[0], unanswered[0] = 0.2 * k, k
            intake.check_audio_room(FRAMER, RATE_BYTES_PER_S)
    assert refused.value.code is ErrorCode.BUFFER_OVERFLOW
    assert "faster than real time" in str(refused.value) and k == 4  # at 5 s unanswered
    assert owner.behind == []


def test_the_pace_forgives_a_quiet_spell_only_up_to_its_catch_up():
    pace = RealTimePace()
    pace.add(0.0, 1.0)
    assert pace.ahead_s(1.0) == pytest.approx(0.0)  # real time
    assert pace.ahead_s(60.0) == pytest.approx(-MAX_CATCH_UP_S)  # a minute quiet: capped
    pace.add(60.0, 5.0)  # a 5 s burst after it is 3 s ahead, not 54 s behind
    assert pace.ahead_s(60.0) == pytest.approx(5.0 - MAX_CATCH_UP_S)


def test_a_turns_end_goes_ahead_on_the_hear_stage_but_never_ahead_of_its_own_session():
    """The hear stage goes by deadline (`Intake.on_stage`): a session's work is due when it
    arrives, its turn's end `TURN_END_AHEAD_S` sooner (ahead of other sessions' partial
    passes queued with it), and never sooner than its own earlier work."""
    from metronome.serve.realtime.intake import TURN_END_AHEAD_S

    dues: list[float] = []
    stage = SimpleNamespace(run=lambda work, due_s: dues.append(due_s))
    clock = [10.0]
    talker = Intake(Owner(), None, stage, lambda: clock[0], Stream([0]),  # type: ignore[arg-type]
                    frame_period_s=1.0, max_buffered_audio_s=4.0, max_text_chars=100)
    neighbour = Intake(Owner(), None, stage, lambda: clock[0],  # type: ignore[arg-type]
                       Stream([0]), frame_period_s=1.0, max_buffered_audio_s=4.0,  # type: ignore[arg-type]
                       max_text_chars=100)
    talker.on_stage(lambda: None)  # a partial pass at 10 s
    clock[0] = 11.0
    neighbour.on_stage(lambda: None, turn_end=True)  # a turn's end at 11 s: due 9 s
    talker.on_stage(lambda: None, turn_end=True)  # its own turn's end: not before its 10 s
    assert dues == [10.0, 11.0 - TURN_END_AHEAD_S, 10.0]
