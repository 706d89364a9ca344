"""The server's shared serving state: one per process, created inside the running loop.

Owns the wall driver (engine thread + beat), observability (metrics on an injected
registry, stall detector, forecast), the admission controller, and the routing of frame
results to sessions. Every method runs on the event loop thread, except `_probe`, which
runs on the engine thread and hands its reading back to the loop.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from prometheus_client import CollectorRegistry

from metronome.admission.controller import AdmissionController, Decision
from metronome.admission.limits import make_limit
from metronome.audio.frontend import AudioFrontEnd
from metronome.engine.engine import Engine
from metronome.engine.types import PoolStats
from metronome.runtime.frame import Frame, FrameResult
from metronome.runtime.observer import RuntimeObserver
from metronome.runtime.ports import StepReport
from metronome.runtime.profile import SessionProfile
from metronome.runtime.wall import WallDriver
from metronome.serve.config import ServerConfig
from metronome.serve.session import RealtimeSession
from metronome.serve.text import ChatText

log = logging.getLogger(__name__)


class ServerRuntime:
    def __init__(self, config: ServerConfig, engine: Engine, tokenizer,
                 registry: CollectorRegistry, model_name: str) -> None:
        self.config = config
        self.engine = engine
        self.model_name = model_name
        self.chat = ChatText(tokenizer) if tokenizer is not None else None
        self.observer = RuntimeObserver.for_engine(engine, registry)
        self.metrics = self.observer.metrics
        self.sessions: dict[str, RealtimeSession] = {}  # admitted, by public id
        self._by_engine_id: dict[int, RealtimeSession] = {}
        self._frontends: dict[int, AudioFrontEnd] = {}
        self.pool: PoolStats = engine.pool_stats()  # latest reading (steps and probes)
        self.resident_tokens: dict[int, int] = {}  # engine session id -> live KV tokens
        self.driver = WallDriver(engine, self._on_result, self._on_step)  # engine thread on
        self.driver.beat.on_late_tokens = self.observer.on_late_tokens
        limit = make_limit(config.admission, config.admission_cap)
        self.controller = AdmissionController(
            limit, lambda: len(self.sessions), config.admission_interval_s,
            on_update=self._on_admission_update,
        )
        self.metrics.set_admission_cap(limit.cap)
        for rate_hz in config.sample_rates_hz:  # now, not on the loop when a session comes
            frontend = self.frontend(rate_hz)
            # first STFT/projection calls set up kernels: pay that now, not in a frame
            frontend.encode(torch.zeros(2 * frontend.fmt.samples_per_token))
        self.controller.start(self.driver.clock, self.driver.now_s())

    # ---- admission and session lifecycle ---------------------------------------------------
    def admit(self) -> Decision:
        decision = self.controller.try_admit(self.now_s())
        label = "admitted" if decision.admitted else f"refused_{decision.reason}"
        self.metrics.admission_decision(label)
        if not decision.admitted:
            self.metrics.session_closed(label)
        return decision

    def add(self, session: RealtimeSession) -> None:
        self.sessions[session.id] = session

    def remove(self, session: RealtimeSession, outcome: str) -> None:
        """Close the session's engine side at once (its blocks go back) and forget it."""
        if self.sessions.pop(session.id, None) is None:
            return
        session.close()
        self.metrics.session_closed(outcome)

    # ---- SessionHost ----------------------------------------------------------------------
    def frontend(self, sample_rate_hz: int) -> AudioFrontEnd:
        if sample_rate_hz not in self._frontends:
            self._frontends[sample_rate_hz] = AudioFrontEnd.for_model(
                self.engine.model.embed_tokens, self.config.audio_format(sample_rate_hz))
        return self._frontends[sample_rate_hz]

    def open_engine_session(self, session: RealtimeSession, profile: SessionProfile) -> int:
        engine_session_id = self.driver.beat.open_session(profile)
        self._by_engine_id[engine_session_id] = session
        return engine_session_id

    def close_engine_session(self, engine_session_id: int) -> None:
        self.driver.beat.close_session(engine_session_id, self.now_s())
        del self._by_engine_id[engine_session_id]  # after: `cancelled` answers still route
        self._probe()

    def submit(self, frame: Frame) -> None:
        self.driver.beat.submit_frame(frame, self.now_s())

    def now_s(self) -> float:
        return self.driver.now_s()

    # ---- runtime callbacks ------------------------------------------------------------------
    def _on_result(self, result: FrameResult) -> None:
        self.observer.on_result(result)
        self.controller.observe(result)
        session = self._by_engine_id.get(result.session_id)
        if session is None:
            return
        try:
            session.on_result(result)
        except Exception:  # one session's failure must not stop the beat for the others
            log.exception("session %s failed on a frame result", session.id)
            session.on_failure()

    def _on_admission_update(self, sample) -> None:
        self.metrics.set_admission_cap(sample.cap)
        self.metrics.set_admission_signal(sample.p95_latency_fraction)

    def _on_step(self, report: StepReport) -> None:
        self.observer.on_step(report)
        self.pool = report.pool
        self.resident_tokens = report.resident_tokens

    def _probe(self) -> None:
        """Read the pool on the engine thread after the commands queued so far (a close),
        so metrics show returned blocks at once, with no engine step to report them."""
        engine, loop = self.engine, self.driver.clock.loop

        def read() -> None:
            pool, num_sessions = engine.pool_stats(), len(engine.sessions)
            with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
                loop.call_soon_threadsafe(self._on_probe, pool, num_sessions)

        self.driver.call_on_engine(read)

    def _on_probe(self, pool: PoolStats, num_sessions: int) -> None:
        self.pool = pool
        self.metrics.set_pool(pool.used_blocks, pool.free_blocks, pool.pinned_blocks)
        self.metrics.set_sessions_active(num_sessions)

    # ---- views ---------------------------------------------------------------------------
    def health(self) -> dict:
        summary = self.observer.health_summary()
        engine_error = self.driver.worker.error
        return {
            "status": "critical" if engine_error else summary["state"],
            "engine_error": engine_error, "stall_detector": summary,
            "sessions": len(self.sessions), "admission": {
                "kind": self.config.admission, "cap": self.controller.limit.cap,
                "counts": dict(self.controller.counts)},
            "kv_pool": vars(self.pool) | {"block_size_tokens": self.config.block_size},
        }

    def session_list(self) -> dict:
        now_s = self.now_s()
        return {"object": "list", "data": [
            s.summary(now_s, self.resident_tokens.get(s.engine_session_id))
            for s in self.sessions.values()
        ], "kv_pool": vars(self.pool)}

    def close(self) -> None:
        self.driver.close()
