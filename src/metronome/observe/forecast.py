"""Saturation forecast: owns the online estimate of when the KV block pool runs dry if the
sessions open now keep growing as they have.

First-order model (the Metronome paper, "Bound the Cache, Keep the Beat for Real-Time
Interaction Model Serving", Meng and Li, 2026): occupancy grows as rho(t) = rho0 + N*r*t,
so the pool is full at t_sat = (1 - rho0) / (N*r). Counted in tokens, that pours the free
room into sessions like a fluid and overestimates by up to one block of time per session;
the pool runs out of *blocks*. So the primary forecast counts whole blocks:

    N growing sessions, each writing r tokens/s; session i has slack s_i tokens left in its
    last block; F free blocks. Blocks go out in rounds (each session takes one per
    block_size/r seconds, the one with the least slack first), so the pool is dry at the
    (F+1)-th request: round q = F // N, j = F % N, and with s_(0) <= s_(1) <= ...

        t_sat = (s_(j) + q * block_size) / r

    With every session in step (same slack) this is the paper's "each session can hold
    floor(F/N) more blocks". The token-level form, kept for comparison, is
    t_sat = (F * block_size + sum(s_i)) / (N * r).

Rate r: for each open session, its resident-token growth from its oldest observation within
the last `window_s` seconds to now (two points: exact for constant rates, and cheap), averaged
over the *growing* sessions. A session grows only if it gained at least `block_size_tokens`
over that span: at steady state a bounded session's resident tokens saw-tooth within a range
of block_size - 1 while its block count stays constant, so smaller changes are not pool
growth. Hence growth slower than one block per window reads as flat; size `window_s` to that.

The forecast is `math.inf` ("never") when no session grows: bounded steady state, shrinking
occupancy, no sessions. Sessions that close are not extrapolated. Slack assumes a growing
session's resident tokens start at a block boundary (unbounded sessions; bounded ones before
their window slides): s_i = (-tokens_i) mod block_size. Call `observe` at a steady cadence
(e.g. once a second); memory is O(observations in the window x sessions).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Forecast:
    made_at_s: float  # time of the observation it was made from
    block_level_s: float  # seconds after made_at_s until the pool is dry (primary); inf: never
    token_level_s: float  # the token-level formula, for comparison
    num_growing_sessions: int
    rate_tokens_per_s: float  # mean growth of one growing session (0.0 when none grows)


NEVER = Forecast(made_at_s=0.0, block_level_s=math.inf, token_level_s=math.inf,
                 num_growing_sessions=0, rate_tokens_per_s=0.0)


class SaturationForecaster:
    def __init__(self, block_size_tokens: int, window_s: float = 30.0) -> None:
        if block_size_tokens < 1 or window_s <= 0:
            raise ValueError(f"need block_size_tokens >= 1 and window_s > 0, got "
                             f"{block_size_tokens}, {window_s}")
        self.block_size_tokens = block_size_tokens
        self.window_s = window_s
        self.forecast = NEVER
        # (time_s, session id -> resident tokens), oldest first, spanning at most window_s
        self._history: deque[tuple[float, dict[str, int]]] = deque()

    def observe(
        self, now_s: float, num_free_blocks: int, session_tokens: Mapping[str, int]
    ) -> Forecast:
        """Record the pool's free blocks and each open session's resident tokens; re-forecast."""
        while self._history and self._history[0][0] < now_s - self.window_s:
            self._history.popleft()
        self._history.append((now_s, dict(session_tokens)))
        rates = self._growth_rates_tokens_per_s(now_s, session_tokens)
        if not rates:
            self.forecast = Forecast(now_s, math.inf, math.inf, 0, 0.0)
            return self.forecast
        rate = sum(rates.values()) / len(rates)
        slacks = sorted(-session_tokens[sid] % self.block_size_tokens for sid in rates)
        rounds, j = divmod(num_free_blocks, len(slacks))
        block_level_s = (slacks[j] + rounds * self.block_size_tokens) / rate
        free_tokens = num_free_blocks * self.block_size_tokens + sum(slacks)
        token_level_s = free_tokens / (len(slacks) * rate)
        self.forecast = Forecast(now_s, block_level_s, token_level_s, len(rates), rate)
        return self.forecast

    def _growth_rates_tokens_per_s(
        self, now_s: float, session_tokens: Mapping[str, int]
    ) -> dict[str, float]:
        """Growth rate of each session that gained at least one block's worth in the window."""
        first_seen: dict[str, tuple[float, int]] = {}
        for time_s, tokens in self._history:
            for sid, num_tokens in tokens.items():
                first_seen.setdefault(sid, (time_s, num_tokens))
        rates: dict[str, float] = {}
        for sid, num_tokens in session_tokens.items():
            since_s, tokens_then = first_seen[sid]
            if num_tokens - tokens_then >= self.block_size_tokens and now_s > since_s:
                rates[sid] = (num_tokens - tokens_then) / (now_s - since_s)
        return rates

    @property
    def predicted_saturation_time_s(self) -> float:
        """Absolute time the pool runs dry (block level); inf when it never does."""
        return self.forecast.made_at_s + self.forecast.block_level_s

    def eta_s(self, now_s: float) -> float:
        """Seconds from `now_s` until the pool runs dry (block level, >= 0); inf: never."""
        return max(0.0, self.predicted_saturation_time_s - now_s)
