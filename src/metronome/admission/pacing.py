"""Self-paced frames: late because of their own session's input, not the server's load.

Owns that one judgement and the little per-session state it needs. A frame is self-paced
when its own session made it wait:
* by size: its own work (its input plus its session's backlog ahead of it) exceeds what one
  engine step processes for a session (`max_own_tokens`): a flood of its own input;
* by pace: its session's input runs more than one frame period ahead of real time
  (`frame_period_s`), and the frame queued behind its session's previous frame (that one
  was answered after this one arrived). The beat works on one frame per session at a time,
  so audio or text sent faster than real time queues behind itself and goes late while
  every step stays fast, and the size rule never sees it (each frame is small).

How far ahead of real time a session is (`ahead_s`): each frame adds one period, the time
since its previous frame takes it away, and credit for input sent late (a pause) is capped
at one period, so a pause does not buy a flood:
    ahead = max(-period, ahead_prev + period - (arrival - arrival_prev)), 0 at the first frame
A real-time client stays within +-one chunk of 0 however it chunks its audio; one that
sends 1 s of audio every 0.15 s is 0.85 s further ahead with each frame. "More than one
period ahead" lets a client's chunking bunch two frames without being judged.

Callers feed every result once, in the order answered (`judge`); `latest(session_id)` is
the verdict on a session's most recent frame, for a listener told only the session id.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass

from metronome.stream import Frame


@dataclass
class _SessionPace:
    arrival_s: float  # of its latest frame
    finish_s: float  # when that frame was answered
    ahead_s: float  # of real time
    self_paced: bool  # the verdict on that frame


class SelfPacing:
    def __init__(self, max_own_tokens: int | None = None,
                 frame_period_s: float | None = None) -> None:
        if frame_period_s is not None and frame_period_s <= 0:
            raise ValueError(f"frame_period_s must be positive, got {frame_period_s}")
        self.max_own_tokens = max_own_tokens  # None: size is never judged
        self.frame_period_s = frame_period_s  # None: pace is never judged
        self._sessions: dict[Hashable, _SessionPace] = {}

    def judge(self, result: Frame) -> bool:
        """Was `result`'s frame self-paced? Call once per result, in the order answered."""
        previous = self._sessions.get(result.session_id)
        ahead_s = self._ahead_s(previous, result.arrival_s)
        limit = self.max_own_tokens
        period = self.frame_period_s
        verdict = (limit is not None and result.own_work_tokens > limit) or (
            period is not None and previous is not None and ahead_s > period
            and previous.finish_s > result.arrival_s)
        self._sessions[result.session_id] = _SessionPace(result.arrival_s, result.finish_s,
                                                         ahead_s, verdict)
        return verdict

    def _ahead_s(self, previous: _SessionPace | None, arrival_s: float) -> float:
        period = self.frame_period_s
        if period is None or previous is None:
            return 0.0
        return max(-period, previous.ahead_s + period - (arrival_s - previous.arrival_s))

    def latest(self, session_id: Hashable) -> bool:
        """The verdict on the session's most recent frame (False: none judged)."""
        pace = self._sessions.get(session_id)
        return pace is not None and pace.self_paced

    def forget_before(self, at_s: float, keep: Collection[Hashable] = ()) -> None:
        """Drop sessions with no frame answered since `at_s` (closed ones among them), but
        those in `keep` (still at work on a long frame)."""
        self._sessions = {sid: pace for sid, pace in self._sessions.items()
                          if pace.finish_s >= at_s or sid in keep}
