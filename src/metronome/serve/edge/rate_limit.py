"""One connection's message rate limit: token buckets for messages and bytes, each with a burst.

A message is accepted when both buckets hold enough for it (one message, its bytes), and
takes that from both. Otherwise it is refused and dropped: the first refusal of a run is
told to the client (an `error`), the rest of the run are dropped silently, so a flood costs
no replies; a run ends at the next accepted message. Every message, accepted or not, also
takes from a second pair of buckets, the client's demand: same rates, twice the bursts. A
client that empties one has gone past the limit by a further whole burst, net of what the
rate gave back meanwhile: it is not slowing down, and the verdict is to close. (A client a
little over the rate gets there too, slowly: 10 % over a 100/s limit with a burst of 200,
after 40 s.) Pure: the caller gives the time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    ACCEPT = "accept"
    REFUSE = "refuse"  # the first refusal of a run: tell the client
    DROP = "drop"  # refused again in the same run: drop it without a reply
    CLOSE = "close"  # a further whole burst over the limit: close the connection


@dataclass
class TokenBucket:
    rate_per_s: float
    burst: float
    tokens: float
    updated_s: float

    @classmethod
    def full(cls, rate_per_s: float, burst: float, now_s: float) -> TokenBucket:
        return cls(rate_per_s, burst, burst, now_s)

    def refill(self, now_s: float) -> None:
        elapsed_s = max(0.0, now_s - self.updated_s)
        self.tokens = min(self.burst, self.tokens + elapsed_s * self.rate_per_s)
        self.updated_s = now_s

    def holds(self, cost: float) -> bool:
        return self.tokens >= cost

    def take(self, cost: float) -> None:
        assert self.holds(cost), (self.tokens, cost)
        self.tokens -= cost


class RateLimit:
    def __init__(self, messages_per_s: float, burst_messages: int, bytes_per_s: float,
                 burst_bytes: int, now_s: float) -> None:
        self.messages = TokenBucket.full(messages_per_s, burst_messages, now_s)
        self.bytes = TokenBucket.full(bytes_per_s, burst_bytes, now_s)
        self.demanded_messages = TokenBucket.full(messages_per_s, 2 * burst_messages, now_s)
        self.demanded_bytes = TokenBucket.full(bytes_per_s, 2 * burst_bytes, now_s)
        self.refusing = False  # in a run of refusals

    def admit(self, num_bytes: int, now_s: float) -> Verdict:
        """The verdict on one message of `num_bytes` (at most the byte burst) at `now_s`."""
        assert num_bytes <= self.bytes.burst, (num_bytes, self.bytes.burst)
        for bucket in (self.messages, self.bytes, self.demanded_messages, self.demanded_bytes):
            bucket.refill(now_s)
        if not (self.demanded_messages.holds(1) and self.demanded_bytes.holds(num_bytes)):
            return Verdict.CLOSE
        self.demanded_messages.take(1)
        self.demanded_bytes.take(num_bytes)
        if self.messages.holds(1) and self.bytes.holds(num_bytes):
            self.messages.take(1)
            self.bytes.take(num_bytes)
            self.refusing = False
            return Verdict.ACCEPT
        verdict = Verdict.DROP if self.refusing else Verdict.REFUSE
        self.refusing = True
        return verdict

    def describe(self) -> str:
        """The limits, for the client's error."""
        return (f"{self.messages.rate_per_s:g} messages/s (burst {self.messages.burst:g}) and "
                f"{self.bytes.rate_per_s:g} bytes/s (burst {self.bytes.burst:g})")
