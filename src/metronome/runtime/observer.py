"""Wires the runtime's events into observability: Prometheus metrics, the silent-stall
detector, the deadline (overload) monitor and the saturation forecast. Subscribes to frame
results and step reports; `health_summary(now_s)` is the one verdict: the worse of the KV
stall and the overload verdicts, each with its reason."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from metronome.engine.types import PoolStats, Rebound, StepOutput
from metronome.observe.deadline_monitor import DeadlineMonitor
from metronome.observe.forecast import SaturationForecaster
from metronome.observe.metrics import Metrics
from metronome.observe.stall_detector import Health, StallDetector
from metronome.stream import Frame


class RuntimeObserver:
    def __init__(
        self,
        metrics: Metrics,
        detector: StallDetector,
        forecaster: SaturationForecaster,
        forecast_interval_s: float = 1.0,
        deadlines: DeadlineMonitor | None = None,
    ) -> None:
        self.metrics = metrics
        self.detector = detector
        self.deadlines = deadlines if deadlines is not None else DeadlineMonitor()
        self.forecaster = forecaster
        self.forecast_interval_s = forecast_interval_s
        self._next_forecast_s = -math.inf
        self.last_pool: PoolStats | None = None
        self.eta_s = math.inf

    @classmethod
    def create(cls, block_size_tokens: int, registry: CollectorRegistry | None = None,
               forecast_window_s: float = 10.0, health_window_s: float | None = None,
               self_paced_tokens: int | None = None) -> RuntimeObserver:
        """For a pool of `block_size_tokens` blocks (`EnginePort.pool_stats().block_size`).
        Defaults: the forecast's fill rate looks back 10 s, so it reads "never" within
        ~10 s of a bounded session reaching steady state, and still sees any session
        growing by a block (16 tokens) per 10 s: far slower than any real-time stream.
        `health_window_s` (the server: its control interval) makes the health verdicts
        cover only that many seconds, from as few as one frame, so stalls, overload and
        recovery show within it; None: the last 200 frames, from 20 on (local runs)."""
        forecaster = SaturationForecaster(block_size_tokens, window_s=forecast_window_s)
        if health_window_s is None:
            detector, deadlines = StallDetector(), DeadlineMonitor(
                self_paced_tokens=self_paced_tokens)
        else:
            detector = StallDetector(window_frames=1 << 16, min_frames=1,
                                     window_s=health_window_s)
            deadlines = DeadlineMonitor(window_frames=1 << 16, min_frames=1,
                                        window_s=health_window_s,
                                        self_paced_tokens=self_paced_tokens)
        return cls(Metrics(registry), detector, forecaster, deadlines=deadlines)

    def on_result(self, result: Frame) -> None:
        num_tokens = len(result.token_ids)
        assert result.status is not None, "listeners hear answered frames only"
        status = result.status.value
        self.metrics.observe_frame(status, result.latency_s, num_tokens, result.good)
        self.detector.observe(status, num_tokens, result.expects_output, result.deadline_met,
                              result.finish_s, result.session_id)
        self.deadlines.observe(status, result.deadline_met, result.own_work_tokens,
                               result.finish_s, result.session_id)
        self.metrics.set_health(self.state)

    @property
    def state(self) -> Health:
        """The health verdict: the worse of KV stalls and deadline misses."""
        return max(self.detector.state, self.deadlines.state)

    def on_late_tokens(self, num_tokens: int) -> None:
        self.metrics.observe_late_tokens(num_tokens)

    def on_rebound(self, rebound: Rebound) -> None:
        self.metrics.session_bounded()

    def on_step(self, out: StepOutput) -> None:
        self.metrics.observe_step(out.step_s, len(out.status))
        assert out.pool is not None, "the driver reads the pool after every step"
        self.observe_pool(out.finished_s, out.pool, out.resident_tokens)

    def observe_pool(self, now_s: float, pool: PoolStats, resident_tokens: dict[str, int],
                     force: bool = False) -> None:
        """A pool reading: after a step, or a probe after a close (an idle engine takes no
        steps, so without it the forecast would keep predicting for sessions long gone).
        `force` re-forecasts now, whatever the cadence."""
        self.last_pool = pool
        self.metrics.set_pool(pool.used_blocks, pool.free_blocks, pool.pinned_blocks)
        self.metrics.set_sessions_active(len(resident_tokens))
        if force or now_s >= self._next_forecast_s:
            self._next_forecast_s = now_s + self.forecast_interval_s
            self.forecaster.observe(now_s, pool.free_blocks, resident_tokens)
        self.eta_s = self.forecaster.eta_s(now_s)
        self.metrics.set_saturation_eta(self.eta_s)

    def health_line(self) -> str:
        return self.state.name.lower()

    def pool_line(self) -> str:
        pool = self.last_pool
        if pool is None:
            return "-"
        eta = "never" if math.isinf(self.eta_s) else f"{self.eta_s:.0f}s"
        return f"{pool.used_blocks}/{pool.num_blocks} used, full in {eta}"

    def advance(self, now_s: float) -> Health:
        """The verdicts as of `now_s` (old frames leave the time windows); updates the
        health gauge, so an idle server's gauge recovers too."""
        self.detector.advance(now_s)
        self.deadlines.advance(now_s)
        self.metrics.set_health(self.state)
        return self.state

    def health_summary(self, now_s: float | None = None) -> dict:
        """The verdict (`state`, `reason`: the worse one's) and both verdicts in full."""
        if now_s is not None:
            self.advance(now_s)
        detector, deadlines = self.detector, self.deadlines
        worst = detector if detector.state >= deadlines.state else deadlines
        forecast = self.forecaster.forecast
        return {
            "state": self.state.name.lower(),
            "reason": worst.reason,
            "kv_stall": {"state": detector.state.name.lower(), "reason": detector.reason,
                         "stalled_fraction": detector.stalled_fraction},
            "overload": {"state": deadlines.state.name.lower(), "reason": deadlines.reason,
                         "missed_fraction": deadlines.missed_fraction,
                         "self_paced_frames": deadlines.num_self_paced},
            "stalled_fraction": detector.stalled_fraction,
            "goodput_ratio": _finite_or_none(self.metrics.goodput_ratio()),
            "saturation_predicted_at_s": self.forecaster.predicted_saturation_time_s,
            "forecast": None if forecast is None else vars(forecast),
        }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
