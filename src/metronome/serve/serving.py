"""The server's serving state, one per process, created inside the running loop.

Owns the runtime (the wall driver: the engine thread and the beat, which holds every
session's `Stream`), admission (the AIMD controller and the memory ceiling), observability
(metrics on an injected registry, the stall detector, the forecast, the loop's lag probe),
the voice stages (`serve.voice.pipeline`: the worker threads that hear and prepare input,
detect turns and speak), the registry of admitted sessions
(`serve.realtime.session.RealtimeSession`, by id) and resuming (`resume.resumer`: each
session's connection, None while it is leased, and what resuming keeps of it). Every method
runs on the event loop thread; `probe` hands a reading to the engine thread, which sends it
back to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable

import torch
from prometheus_client import CollectorRegistry

from metronome.admission.controller import AdmissionController, CapSample, Decision
from metronome.admission.limits import make_limit
from metronome.audio.frontend import AudioFrontEnd
from metronome.engine.types import EngineFeature, PoolStats, StepOutput
from metronome.kv.residency import ResidencyPolicy
from metronome.observe.metrics import Metrics
from metronome.runtime.beat import Beat
from metronome.runtime.observer import RuntimeObserver
from metronome.runtime.ports import EnginePort, Listeners
from metronome.runtime.wall import WallDriver
from metronome.serve.config import ServerConfig
from metronome.serve.edge.loop_lag import LoopLagProbe
from metronome.serve.protocol import ClientError, ErrorCode, ErrorType
from metronome.serve.protocol.errors import Refused
from metronome.serve.realtime.bound import BoundLimits
from metronome.serve.realtime.chat import ChatText
from metronome.serve.realtime.session import RealtimeSession
from metronome.serve.resume.checkpoint import CheckpointStore
from metronome.serve.resume.lease import RESUME_QUERY
from metronome.serve.resume.resumer import Resumer
from metronome.serve.resume.state import Client
from metronome.serve.status import StatusBoard
from metronome.serve.voice.pipeline import VoiceStages

log = logging.getLogger(__name__)
GOING_AWAY_CLOSE_CODE = 1001  # the drain timeout passed
TRY_AGAIN_LATER_CLOSE_CODE = 1013  # refused by admission (a client past the upgrade)


class Serving:
    def __init__(self, config: ServerConfig, engine: EnginePort, tokenizer,
                 registry: CollectorRegistry, model_name: str,
                 checkpoint_store: CheckpointStore | None = None,
                 server_name: str = "local") -> None:
        self.config = config
        self.engine = engine
        self.model_name = model_name
        self.chat = ChatText(tokenizer) if tokenizer is not None else None
        # what a session's bound may be (`session.truncation`, its instructions' pin): its
        # own where the engine serves one per session
        self.bound_limits = BoundLimits(
            ResidencyPolicy.parse(config.policy), config.block_size, config.max_window_tokens,
            config.max_pinned_tokens, config.allow_unbounded_sessions,
            per_session=EngineFeature.SESSION_POLICY in engine.features)
        # Health covers one control interval, and frames slow by their own session's input
        # (more than one step's chunk of it) are no sign of load: the controller's rules.
        self_paced_tokens = engine.config.max_chunk_tokens
        self.observer = RuntimeObserver.create(
            engine.pool_stats().block_size, registry,
            health_window_s=config.admission_interval_s, self_paced_tokens=self_paced_tokens)
        self.metrics: Metrics = self.observer.metrics
        self.sessions: dict[str, RealtimeSession] = {}  # admitted, by id
        self.draining = False  # set once (`drain`): no new session from then on
        self._frontends: dict[int, AudioFrontEnd] = {}  # by sample rate
        # The voice stages, each a thread of its own (`serve.voice.pipeline`): hearing (and
        # every frame's input: audio encoded, text tokenized) off the loop, so one session's
        # input never delays another's deadline timers; turn detection apart, so detecting
        # a turn never delays a frame's input; speaking apart, so it never delays hearing.
        # Hearing and speaking need a tokenizer: the words enter the KV as text, the reply
        # is spoken from text.
        self.stages = VoiceStages.start(
            asyncio.get_running_loop(), self.metrics,
            hears=config.audio_input == "transcribe" and self.chat is not None,
            speaks=config.output_audio and self.chat is not None,
            whisper_threads=config.whisper_threads, whisper_window_s=config.whisper_window_s)
        self.pool: PoolStats = engine.pool_stats()  # latest reading (steps and probes)
        limit = make_limit(config.admission, config.admission_cap)
        self.controller = AdmissionController(
            limit, lambda: len(self.sessions), config.admission_interval_s,
            on_update=self._on_admission_update,
            memory_ceiling=_memory_ceiling(config, engine),
            self_paced_tokens=self_paced_tokens, frame_period_s=config.frame_period_s,
        )
        # Health leaves out the frames the controller judged self-paced (more than one step's
        # chunk of their own input, or input faster than real time), so the controller hears
        # of each result before the observer does.
        self.observer.deadlines.self_paced_session = self.controller.pacing.latest
        self.observer.deadlines.steered = lambda: bool(
            self.controller.history) and self.controller.history[-1].steered
        self.status_board = StatusBoard()  # the status page's per-session frame strips
        self.driver = WallDriver(engine, Listeners.of(self.controller, self.observer, self,
                                                      self.status_board))
        self.metrics.set_admission_cap(limit.cap)
        self.metrics.set_memory_ceiling(self.controller.memory_ceiling)
        for rate_hz in config.sample_rates_hz if self.accepts_audio else ():
            frontend = self.frontend(rate_hz)  # first STFT/projection calls set up kernels:
            frontend.encode(torch.zeros(2 * frontend.fmt.samples_per_token))  # pay it now
        self.controller.start(self.driver.timer, self.driver.now_s())
        self.loop_lag = LoopLagProbe(self.driver.loop, registry)  # the attack suite's gauge
        self.loop_lag.start()
        self.resume = Resumer(self, checkpoint_store, server_name)

    @property
    def beat(self) -> Beat:
        return self.driver.beat

    @property
    def hooks(self) -> Resumer:
        """What the server hears of each session (`RealtimeSession`'s `SessionHooks`)."""
        return self.resume

    def now_s(self) -> float:
        return self.driver.now_s()

    def observe_output_gap(self, gap_s: float) -> None:
        """A reply's listener ran dry: a miss in admission's interval (`on_output_gap`)."""
        self.controller.on_output_gap(gap_s)

    def observe_input_behind(self, first: bool) -> None:
        """A session's real-time audio was kept past its buffer bound: a miss in admission's
        interval (`on_input_behind`), counted (`first`: a new stretch behind)."""
        self.controller.on_input_behind()
        self.metrics.input_behind(first)

    # ---- admission and session lifecycle ---------------------------------------------------
    async def open(self, connection: Client) -> tuple[RealtimeSession, Callable[[], None]]:
        """The session a new connection serves, and what to do once it is accepted: the one
        it resumes (`?resume=`: `serve.resume`), or a new one if admission lets it in; else
        `Refused` (before the upgrade)."""
        resume_id = connection.query(RESUME_QUERY)
        if resume_id is not None:
            return await self.resume.attach(resume_id, connection)
        decision = self.admit()
        if not decision.admitted:
            retry_after_s = max(1, math.ceil(decision.retry_after_s))
            raise Refused(503, TRY_AGAIN_LATER_CLOSE_CODE, f"at capacity; retry in "
                          f"{retry_after_s} s", ErrorCode.AT_CAPACITY,
                          f"the server is at capacity ({decision.reason}); retry in "
                          f"{retry_after_s} s", ErrorType.SERVER,
                          {"Retry-After": str(retry_after_s)})
        session = RealtimeSession(self, connection, extensions=connection.extensions)
        self.add(session, connection)  # before any await: admission counts it
        return session, lambda: self.start(session, connection)

    def admit(self) -> Decision:
        decision = Decision(False, "draining", self.config.admission_interval_s) if (
            self.draining) else self.controller.try_admit(self.now_s())
        label = "admitted" if decision.admitted else f"refused_{decision.reason}"
        self.metrics.admission_decision(label)
        if not decision.admitted:
            self.metrics.session_closed(label)
        return decision

    def add(self, session: RealtimeSession, connection: Client) -> None:
        """An admitted session, `connection`'s (admission counts it from now on)."""
        self.sessions[session.id] = session
        self.resume.admitted(session, connection)

    def start(self, session: RealtimeSession, connection: Client) -> None:
        """A new session's connection is accepted: its resume token (for a client that
        reads it), `session.created`, then resumable on another server."""
        self.resume.grant(session, connection)
        session.start()
        self.resume.opened(session)

    def release(self, session: RealtimeSession, connection: Client, outcome: str,
                dropped: bool) -> None:
        """`connection` ended: its session ends too, unless it was resumed on another
        connection already or, its client dropped, it is leased for a resume."""
        if self.resume.connection_of(session) is not connection:
            return  # resumed on another connection, which has it now (or it ended)
        if dropped and session.channel.attached and self.resume.lease(
                session, connection.resume_from(), connection.hold_lease):
            return  # held for its client to resume
        self.remove(session, outcome)

    def remove(self, session: RealtimeSession, outcome: str) -> None:
        """End the session: its stream closes at once (its blocks go back) and it is
        forgotten (a session that moved to another server stays in the checkpoint store)."""
        self.resume.ended(session, outcome)
        if self.sessions.pop(session.id, None) is None:
            return
        session.close()
        self.probe()
        self.metrics.session_closed(outcome)

    def drain(self, timeout_s: float) -> None:
        """Take no new session from now on (refused as at capacity, reason `draining`), and
        close those still open after `timeout_s` (1001 going away); once set, for good."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: %d sessions open, %s, closed in %g s if still open",
                 len(self.sessions), "each moved to another server once it is between frames"
                 if self.resume.checkpoints is not None else "none moved (no checkpoint store)",
                 timeout_s)
        self.driver.loop.call_later(timeout_s, self._drain_timeout)
        for session in list(self.sessions.values()):
            self.resume.migrate(session)

    def _drain_timeout(self) -> None:
        error = ClientError(ErrorCode.SERVER_DRAINING, "this server is being removed and its "
                            "drain timeout has passed: reconnect to continue elsewhere",
                            error_type=ErrorType.SERVER)
        for session in list(self.sessions.values()):
            connection = self.resume.connection_of(session)
            if connection is not None:
                connection.end("drained", GOING_AWAY_CLOSE_CODE,
                               "server draining: drain timeout", error)
            else:
                self.remove(session, "drained")

    # ---- input ---------------------------------------------------------------------------------
    @property
    def accepts_audio(self) -> bool:
        """The engine takes the audio front end's embeddings (vLLM's streaming input: not)."""
        return self.engine.accepts_embeddings

    def frontend(self, sample_rate_hz: int) -> AudioFrontEnd:
        if sample_rate_hz not in self._frontends:
            fmt, model = self.config.audio_format(sample_rate_hz), self.engine.model
            self._frontends[sample_rate_hz] = AudioFrontEnd.for_model(
                model.embed_tokens, fmt) if self.accepts_audio and model is not None else (
                AudioFrontEnd(fmt, hidden_size=1, embed_rms=1.0))  # framing only: never encodes
        return self._frontends[sample_rate_hz]

    # ---- readings -------------------------------------------------------------------------
    def on_step(self, out: StepOutput) -> None:
        """A runtime listener: the pool after each step."""
        assert out.pool is not None, "the driver reads the pool after every step"
        self.pool = out.pool

    def _on_admission_update(self, sample: CapSample) -> None:
        self.metrics.set_admission_cap(sample.cap)
        self.metrics.set_admission_signal(sample.percentile / 100, sample.latency_fraction)
        self.observer.advance(sample.at_s)  # the health gauge recovers on an idle server too

    def probe(self) -> None:
        """Read the pool on the engine thread after the commands queued so far (a close),
        so metrics show returned blocks at once, with no engine step to report them."""
        engine, loop = self.engine, self.driver.loop

        def read() -> None:
            pool, resident = engine.pool_stats(), engine.resident_tokens_by_session()
            with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
                loop.call_soon_threadsafe(self._on_probe, pool, resident)

        self.driver.call_on_engine(read)

    def _on_probe(self, pool: PoolStats, resident_tokens: dict[str, int]) -> None:
        self.pool = pool
        # a close changes the forecast's sessions: re-forecast now, steps or not
        self.observer.observe_pool(self.now_s(), pool, resident_tokens, force=True)

    def health(self) -> dict:
        """The server's verdict as of now (`status`: ok | degraded | critical) with its
        reason, then the evidence: the KV-stall and overload verdicts over the last control
        interval, admission (cap, memory ceiling) and the pool."""
        summary = self.observer.health_summary(self.now_s())
        engine_error = self.driver.error
        controller = self.controller
        return {
            "status": "critical" if engine_error else summary["state"],
            "reason": f"engine step failed: {engine_error}" if engine_error else (
                summary["reason"]),
            "engine_error": engine_error,
            "stall_detector": summary["kv_stall"] | {
                "saturation_predicted_at_s": summary["saturation_predicted_at_s"],
                "forecast": summary["forecast"]},
            "overload": summary["overload"], "goodput_ratio": summary["goodput_ratio"],
            "sessions": len(self.sessions), "leased_sessions": self.num_leased,
            "draining": self.draining, "admission": {
                "kind": self.config.admission, "cap": controller.limit.cap,
                "memory_ceiling": controller.memory_ceiling,
                "effective_cap": controller.effective_cap, "counts": dict(controller.counts)},
            "kv_pool": vars(self.pool) | {"block_size_tokens": self.config.block_size},
        }

    @property
    def num_leased(self) -> int:
        return sum(self.resume.connection_of(session) is None
                   for session in self.sessions.values())

    def session_list(self) -> dict:
        now_s = self.now_s()
        data = [session.summary(now_s) | self.resume.describe(session, now_s)
                for session in self.sessions.values()]
        return {"object": "list", "data": data, "kv_pool": vars(self.pool)}

    def close(self) -> None:
        self.loop_lag.stop()
        self.driver.close()
        self.stages.close()


def _memory_ceiling(config: ServerConfig, engine: EnginePort) -> int | None:
    """Sessions the pool holds, each counted at `--session-reservation-tokens`, or at what one
    under the server's bound holds at its peak (None: unbounded, no ceiling)."""
    tokens = config.session_reservation_tokens
    if tokens is None:
        return engine.memory_ceiling(_ceiling_policy(config, engine))
    pool = engine.pool_stats()
    return pool.num_blocks // -(-tokens // pool.block_size)


def _ceiling_policy(config: ServerConfig, engine: EnginePort) -> ResidencyPolicy:
    """The bound that sizes sessions for the memory ceiling: the server's, or, for unbounded
    sessions under graceful degradation, the bound they are switched to at the wall (so
    every admitted session fits once bound: none is ever stuck)."""
    policy = ResidencyPolicy.parse(config.policy)
    pressure = engine.config.pressure_policy
    return pressure if not policy.bounded and pressure is not None else policy
