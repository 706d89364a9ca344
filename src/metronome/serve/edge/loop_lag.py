"""The event loop's lag, as a probe timer sees it: how late a timer due every
`PROBE_PERIOD_S` actually runs. Everything a connection does runs on this loop (parsing,
validating, its events, frame results), so a probe that runs late is every session's
deadline timer running late by as much. Each reading goes into a histogram on the server's
registry (`LOOP_LAG_SECONDS`): how many probes were later than 50 ms over any interval is a
difference of two scrapes, which is what the attack suite asserts.

The metric's name is kept here, beside its only writer: `observe.metrics` holds the
runtime's, and the loop is the server's.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

LOOP_LAG_SECONDS = "metronome_event_loop_lag_seconds"
PROBE_PERIOD_S = 0.01  # ~100 callbacks/s of a few us each: ~0.05 % of the loop
LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class LoopLagProbe:
    def __init__(self, loop: asyncio.AbstractEventLoop, registry: CollectorRegistry,
                 period_s: float = PROBE_PERIOD_S) -> None:
        self.loop = loop
        self.period_s = period_s
        self._lag = Histogram(LOOP_LAG_SECONDS, "How late the event loop ran a probe timer "
                              f"due every {period_s:g} s.", buckets=LAG_BUCKETS_S,
                              registry=registry)
        self._due_s = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._schedule(self.loop.time())

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self, now_s: float) -> None:
        self._due_s = now_s + self.period_s
        self._timer = self.loop.call_at(self._due_s, self._on_probe)

    def _on_probe(self) -> None:
        now_s = self.loop.time()
        self._lag.observe(max(0.0, now_s - self._due_s))
        self._schedule(now_s)
