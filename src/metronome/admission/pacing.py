"""Self-paced frames: late because of their own session's input, not the server's load.

Owns that one judgement and the little per-session state it needs. A frame is self-paced
when its own session made it wait:
* by size: its own work (its input plus its session's backlog ahead of it) exceeds what one
  engine step processes for a session (`max_own_tokens`): a flood of its own input;
* by pace: its session's input has arrived more than one frame period ahead of real time
  (`frame_period_s`), and the frame queued behind its session's previous frame (that one
  was answered after this one arrived). The beat works on one frame per session at a time,
  so audio or text sent faster than real time queues behind itself and goes late while
  every step stays fast, and the size rule never sees it (each frame is small).

How far ahead of real time a session is (`ahead_s`) is judged from its input's arrival
against the wall clock only: the input received (one period per frame after the first)
less the wall time since its first frame arrived,
    ahead_s = frames_since_first x period - (arrival_s - first_arrival_s),
with credit for being behind capped at `max_behind_s` (the time origin slides forward when
a session falls further behind than that). Kept as a running value, frame by frame:
    ahead = max(-max_behind, ahead_prev + period - (arrival - arrival_prev)), 0 at the first
A real-time client stays within +-one chunk of 0 however it chunks its audio, and a
streamer whose frames arrived late (its sender starved, or a lagging server loop read them
late) and then in a bunch only catches up to 0: it was behind, never ahead. One that sends
1 s of audio every 0.15 s is 0.85 s further ahead with each frame. "More than one period
ahead" lets a client's chunking bunch two frames without being judged.

Why the cap (`max_behind_s`, default `MAX_BEHIND_S` = 5 s, never less than one period): it
is the catch-up allowance. A lag of a few seconds on a slow or busy host (frames read 2-3
periods late at 1 s frames, then all at once: issue 43) must be caught up without credit
running out, or the catch-up would read as "ahead" (a cap of one period did exactly that:
the streamers' frames were judged self-paced and the attackers' work share no longer
looked outsized). But credit must stay bounded, or a client that paused for a minute could
then flood for a minute unjudged: after any pause a client can send at most `max_behind_s`
+ one period of input ahead of its pace before its frames are judged (the server buffers
only 4 s of unanswered audio a session anyway, `max_buffered_audio_s`).

Callers feed every result once, in the order answered (`judge`); `latest(session_id)` is
the verdict on a session's most recent frame, for a listener told only the session id.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass, replace

from metronome.stream import Frame

MAX_BEHIND_S = 5.0  # catch-up allowance: a lag of 2-3 s (issue 43) with room to spare


@dataclass
class _SessionPace:
    arrival_s: float  # of its latest frame
    finish_s: float  # when that frame was answered
    ahead_s: float  # of real time: input received less wall time, at least -max_behind
    self_paced: bool  # the verdict on that frame


class SelfPacing:
    def __init__(self, max_own_tokens: int | None = None,
                 frame_period_s: float | None = None,
                 max_behind_s: float = MAX_BEHIND_S) -> None:
        if frame_period_s is not None and frame_period_s <= 0:
            raise ValueError(f"frame_period_s must be positive, got {frame_period_s}")
        if max_behind_s < 0:
            raise ValueError(f"max_behind_s must not be negative, got {max_behind_s}")
        self.max_own_tokens = max_own_tokens  # None: size is never judged
        self.frame_period_s = frame_period_s  # None: pace is never judged
        # credit for input behind real time; never less than one period (chunking jitter)
        self.max_behind_s = max(max_behind_s, frame_period_s or 0.0)
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
        return max(-self.max_behind_s,
                   previous.ahead_s + period - (arrival_s - previous.arrival_s))

    def latest(self, session_id: Hashable) -> bool:
        """The verdict on the session's most recent frame (False: none judged)."""
        pace = self._sessions.get(session_id)
        return pace is not None and pace.self_paced

    def forget_before(self, at_s: float, keep: Collection[Hashable] = ()) -> None:
        """Sessions with no frame answered since `at_s`, but those in `keep` (still at work
        on a long frame), lose their verdict (an idle flood is no longer self-paced). Their
        pace is kept `max_behind_s` longer, then dropped (closed sessions among them): a
        streamer whose frames a lagging loop reads seconds late answers nothing meanwhile,
        and restarted at 0 its catch-up bunch would read as ahead of real time."""
        kept: dict[Hashable, _SessionPace] = {}
        for sid, pace in self._sessions.items():
            if pace.finish_s >= at_s or sid in keep:
                kept[sid] = pace
            elif pace.finish_s >= at_s - self.max_behind_s:
                kept[sid] = replace(pace, self_paced=False)
        self._sessions = kept
