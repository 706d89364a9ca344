"""`serve.resume.takeover.LoggedEvents`: logged client events land at their place (frames
answered), live ones queue behind them (applied right after the last), and a quiescent
session never holds queued input back."""

from __future__ import annotations

from metronome.serve.resume.takeover import LoggedEvents as Replay
from metronome.serve.resume.takeover import log_entry, read_entry


class Session:
    def __init__(self) -> None:
        self.frames, self.responding, self.applied = 0, False, []

    def apply(self, text: str, logged: bool) -> None:
        self.applied.append((text, logged))
        if text == "response.create":
            self.responding = True


def _replay(session: Session, logged: list[tuple[int, str]]) -> tuple[Replay, callable]:
    replay = Replay(logged, session.apply)
    return replay, lambda: replay.due(lambda: session.frames,
                                      lambda: not session.responding)


def test_log_entries_round_trip():
    assert read_entry(log_entry(7, '{"type": "x"}')) == (7, '{"type": "x"}')


def test_each_turn_waits_for_the_response_before_it_and_live_events_queue_behind():
    session = Session()
    replay, due = _replay(session, [(0, "item 0"), (0, "response.create"), (3, "item 1"),
                                    (3, "response.create")])
    due()  # at restore: the first turn
    assert [t for t, _ in session.applied] == ["item 0", "response.create"]
    replay.offer("item 2")  # the client's, on the new connection
    for session.frames in (1, 2):  # the replayed response's frames, not yet done
        due()
    assert len(session.applied) == 2
    session.frames, session.responding = 3, False  # its last result
    due()  # the second turn, then the live event: sent after all of it, due right after
    assert session.applied[2:] == [("item 1", True), ("response.create", True),
                                   ("item 2", False)]
    assert not replay.pending


def test_a_quiescent_session_applies_what_waits_for_frames_that_will_not_come():
    session = Session()
    replay, due = _replay(session, [(0, "append"), (4, "append"), (9, "commit")])
    due()  # quiescent at 0 frames (nothing responding): nothing holds the input back
    assert [t for t, _ in session.applied] == ["append", "append", "commit"]
    assert not replay.pending
