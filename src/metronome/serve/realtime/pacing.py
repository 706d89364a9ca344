"""A reply's listener: what it has been given to play, and where it ran dry.

A spoken reply is an output stream, not one answer. After its first audio the reply only has
to stay ahead of playback: the audio already sent is the listener's buffer, and the reply is
late only when that buffer runs out before the next piece arrives, a **gap** the listener
hears. `Playback` is that listener, played at real time from the moment the first piece
arrives: each piece (its arrival and its playing time) extends what is buffered; a piece that
arrives after the buffer ran out opens a gap of the time it ran dry. A text reply is read at
a pace (`text_pace_tokens_per_s`, the server's `--text-pace-tokens-per-s`): each token is
that much reading time, so a text reply has gaps by the same rule.

What this does not model: the client's own jitter buffer and the network (the time counts
from when the server sends), so a gap here is one the server caused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Playback:
    """The listener of one reply, on the server's clock (seconds)."""

    started_s: float | None = None  # when its first output was sent
    ends_at_s: float = -math.inf  # when what it was given runs out, played at real time
    played_s: float = 0.0  # the playing time of all it was given
    gap_ms: list[float] = field(default_factory=list)  # each gap, as long as it ran dry

    def add(self, now_s: float, duration_s: float) -> float:
        """A piece of `duration_s` of playing time sent at `now_s`: the gap it ends (0.0:
        the listener had not run dry)."""
        assert duration_s >= 0 and now_s >= (self.started_s or -math.inf), (now_s, self)
        gap_s = 0.0
        if self.started_s is None:
            self.started_s, self.ends_at_s = now_s, now_s
        elif now_s > self.ends_at_s:
            gap_s = now_s - self.ends_at_s
            self.gap_ms.append(gap_s * 1e3)
        self.ends_at_s = max(self.ends_at_s, now_s) + duration_s
        self.played_s += duration_s
        return gap_s

    @property
    def gap_count(self) -> int:
        return len(self.gap_ms)

    @property
    def total_gap_ms(self) -> float:
        return sum(self.gap_ms)

    def buffered_s(self, now_s: float) -> float:
        """What the listener has left to play at `now_s`."""
        return max(0.0, self.ends_at_s - now_s)
