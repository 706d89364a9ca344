"""Wires the runtime's events into observability: Prometheus metrics, the silent-stall
detector and the saturation forecast. Subscribes to frame results and step reports."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from metronome.observe.forecast import SaturationForecaster
from metronome.observe.metrics import Metrics
from metronome.observe.stall_detector import StallDetector
from metronome.runtime.frame import FrameResult
from metronome.runtime.ports import StepReport


class RuntimeObserver:
    def __init__(
        self,
        metrics: Metrics,
        detector: StallDetector,
        forecaster: SaturationForecaster,
        forecast_interval_s: float = 1.0,
    ) -> None:
        self.metrics = metrics
        self.detector = detector
        self.forecaster = forecaster
        self.forecast_interval_s = forecast_interval_s
        self._next_forecast_s = -math.inf
        self.last_pool = None
        self.eta_s = math.inf

    @classmethod
    def create(cls, block_size_tokens: int, registry: CollectorRegistry | None = None,
               forecast_window_s: float = 10.0) -> RuntimeObserver:
        """For a pool of `block_size_tokens` blocks (`EnginePort.pool_stats().block_size`).
        Defaults: the forecast's fill rate looks back 10 s, so it reads "never" within
        ~10 s of a bounded session reaching steady state, and still sees any session
        growing by a block (16 tokens) per 10 s: far slower than any real-time stream."""
        forecaster = SaturationForecaster(block_size_tokens, window_s=forecast_window_s)
        return cls(Metrics(registry), StallDetector(), forecaster)

    def on_result(self, result: FrameResult) -> None:
        num_tokens = len(result.token_ids)
        self.metrics.observe_frame(result.status.value, result.latency_s, num_tokens,
                                   result.good)
        self.detector.observe(result.status.value, num_tokens, result.expects_output,
                              result.deadline_met)
        self.metrics.set_health(self.detector.state)

    def on_late_tokens(self, num_tokens: int) -> None:
        self.metrics.observe_late_tokens(num_tokens)

    def on_step(self, report: StepReport) -> None:
        pool = report.pool
        self.last_pool = pool
        self.metrics.observe_step(report.step_s, len(report.result.sessions))
        self.metrics.set_pool(pool.used_blocks, pool.free_blocks, pool.pinned_blocks)
        self.metrics.set_sessions_active(len(report.resident_tokens))
        if report.finished_s >= self._next_forecast_s:
            self._next_forecast_s = report.finished_s + self.forecast_interval_s
            self.forecaster.observe(report.finished_s, pool.free_blocks, report.resident_tokens)
        self.eta_s = self.forecaster.eta_s(report.finished_s)
        self.metrics.set_saturation_eta(self.eta_s)

    def health_line(self) -> str:
        return self.detector.state.name.lower()

    def pool_line(self) -> str:
        pool = self.last_pool
        if pool is None:
            return "-"
        eta = "never" if math.isinf(self.eta_s) else f"{self.eta_s:.0f}s"
        return f"{pool.used_blocks}/{pool.num_blocks} used, full in {eta}"

    def health_summary(self) -> dict:
        forecast = self.forecaster.forecast
        return {
            "state": self.detector.state.name.lower(),
            "reason": self.detector.reason,
            "stalled_fraction": self.detector.stalled_fraction,
            "saturation_predicted_at_s": self.forecaster.predicted_saturation_time_s,
            "forecast": None if forecast is None else vars(forecast),
        }
