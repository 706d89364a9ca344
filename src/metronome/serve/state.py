"""The server's shared serving state: one per process, created inside the running loop.

Owns the wall driver (engine thread + beat), observability (metrics on an injected
registry, stall detector, forecast, the loop's lag probe), the admission controller, the
encoder thread (audio encoding and text tokenizing), the VAD thread with its Silero network
(loaded there on first use) and the admitted sessions. Every method runs on the event loop
thread; `_probe` hands a function to the engine thread, which sends its reading back to the
loop.

It knows sessions only as `AdmittedSession` (close, describe, their event channel) and
their connections only as `SessionOwner` (go away, hand over): the Realtime session
(`serve.session`) depends on this state through its `SessionHost` protocol, not the other
way round. A session whose client dropped is leased here for the resume grace
(`serve.resume`): still admitted, still counted, its owner gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

import torch
from prometheus_client import CollectorRegistry

from metronome.admission.controller import AdmissionController, CapSample, Decision
from metronome.admission.limits import make_limit
from metronome.audio.frontend import AudioFrontEnd
from metronome.audio.silero import SileroVad
from metronome.engine.engine import Engine
from metronome.engine.types import PoolStats, Rebound
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.cores import single_threaded
from metronome.runtime.frame import Frame, FrameResult
from metronome.runtime.observer import RuntimeObserver
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionProfile
from metronome.runtime.record import Accepted, SessionRecord
from metronome.runtime.wall import WallDriver
from metronome.serve.checkpoint import CheckpointStore
from metronome.serve.checkpointing import Checkpointer, Restored
from metronome.serve.config import ServerConfig
from metronome.serve.edge.loop_lag import LoopLagProbe
from metronome.serve.event_stream import EventChannel
from metronome.serve.protocol import ClientError, ErrorCode, ErrorType
from metronome.serve.replay import Replay
from metronome.serve.resume import Resumption
from metronome.serve.status import StatusBoard
from metronome.serve.text import ChatText

log = logging.getLogger(__name__)
T = TypeVar("T")


class AdmittedSession(Protocol):
    id: str

    def close(self) -> None: ...

    def summary(self, now_s: float, resident_kv_tokens: int | None) -> dict: ...

    channel: EventChannel  # where its events go: detached while it is leased


class SessionOwner(Protocol):
    """A session's connection, as the state tells it to end."""

    def go_away(self) -> None:
        """The server drains and its timeout passed: close 1001."""

    def migrate(self) -> None:
        """The server drains and the session is checkpointed: close 4002, the client
        resumes it on another server."""

    def hand_over(self) -> int:
        """The session was resumed on another connection: close 4001, leave the session, and
        say from which event of the session's stream the client may not have it."""


class ResumeRefused(ClientError):
    """A resume that cannot be honoured, answered before the upgrade with `http_status`."""

    def __init__(self, http_status: int, code: ErrorCode, message: str,
                 error_type: ErrorType = ErrorType.INVALID_REQUEST) -> None:
        super().__init__(code, message, error_type=error_type)
        self.http_status = http_status


class ServerState:
    def __init__(self, config: ServerConfig, engine: Engine, tokenizer,
                 registry: CollectorRegistry, model_name: str,
                 checkpoint_store: CheckpointStore | None = None,
                 server_name: str = "local") -> None:
        self.config = config
        self.engine = engine
        self.model_name = model_name
        self.chat = ChatText(tokenizer) if tokenizer is not None else None
        # Health covers one control interval, and frames slow by their own session's input
        # (more than one step's chunk of it) are no sign of load: the controller's rules.
        self_paced_tokens = engine.config.max_chunk_tokens
        self.observer = RuntimeObserver.create(
            engine.pool_stats().block_size, registry,
            health_window_s=config.admission_interval_s, self_paced_tokens=self_paced_tokens)
        self.metrics = self.observer.metrics
        self.sessions: dict[str, AdmittedSession] = {}  # admitted, by public id
        self.owners: dict[str, SessionOwner] = {}  # by public id: its connection; absent:
        # the session is leased (its client dropped; `serve.resume`)
        self.draining = False  # set once (`drain`): no new session from then on
        self._migrating: set[str] = set()  # draining: checkpoint under way, then closed 4002
        self.replays: dict[str, Replay] = {}  # taken-over sessions still replaying events
        self._frontends: dict[int, AudioFrontEnd] = {}
        # One thread prepares every session's input, audio (log-mel + projection) and text
        # (tokenizing): off the loop, so one session's input never delays another's deadline
        # timers, and in submission order, so each session's stateful encoder sees its audio
        # in sequence.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metronome-audio",
                                           initializer=single_threaded)
        # Server VAD has a thread of its own: detecting a turn never delays a frame's
        # encoding, and each session's VAD stream sees its audio in sequence. The network
        # runs in ONNX Runtime on that one thread: the engine's torch threads are untouched.
        self._vad = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metronome-vad",
                                       initializer=single_threaded)
        self._silero: SileroVad | None = None  # the VAD thread's only
        # An executor starts its thread on its first submit, on the caller's thread: the loop
        # paid 1-4 ms of CPU for it on a session's first text or audio. Start them now.
        for executor in (self._encoder, self._vad):
            executor.submit(lambda: None).result()
        self.pool: PoolStats = engine.pool_stats()  # latest reading (steps and probes)
        self.resident_tokens: dict[int, int] = {}  # engine session id -> live KV tokens
        limit = make_limit(config.admission, config.admission_cap)
        self.controller = AdmissionController(
            limit, lambda: len(self.sessions), config.admission_interval_s,
            on_update=self._on_admission_update,
            memory_ceiling=engine.memory_ceiling(_ceiling_policy(config, engine)),
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
        self.resumption = Resumption(config.resume_grace_s, self.driver.loop, self.metrics,
                                     self._end_leased)
        # Checkpoints to a store beyond this server (a cluster's: `serve.checkpointing`), so
        # another server resumes a session this one held; they need resume tokens and the
        # native engine's snapshots.
        self.checkpoints = Checkpointer(
            checkpoint_store, server_name, config.checkpoint_interval_s, engine,
            self.driver.run_on_engine, self.resumption.credentials, self.metrics,
            self.moved, self.now_s) if (
            checkpoint_store is not None and config.checkpoint_interval_s > 0
            and self.resumption.enabled and hasattr(engine, "snapshot_session")) else None

    # ---- admission and session lifecycle ---------------------------------------------------
    def admit(self) -> Decision:
        decision = Decision(False, "draining", self.config.admission_interval_s) if (
            self.draining) else self.controller.try_admit(self.now_s())
        label = "admitted" if decision.admitted else f"refused_{decision.reason}"
        self.metrics.admission_decision(label)
        if not decision.admitted:
            self.metrics.session_closed(label)
        return decision

    def add(self, session: AdmittedSession, owner: SessionOwner) -> None:
        self.sessions[session.id] = session
        self.owners[session.id] = owner

    def remove(self, session: AdmittedSession, outcome: str) -> None:
        """Close the session's engine side at once (its blocks go back) and forget it (a
        session that `moved` to another server, or `migrated` there by a drain, stays in the
        checkpoint store)."""
        self.owners.pop(session.id, None)
        self.replays.pop(session.id, None)
        self.resumption.forget(session.id, outcome)
        if self.checkpoints is not None:
            self.checkpoints.ended(session.id, keep=outcome in ("moved", "migrated"))
        if self.sessions.pop(session.id, None) is None:
            return
        session.close()
        self.metrics.session_closed(outcome)

    # ---- checkpoints (serve.checkpointing) ---------------------------------------------------
    def settled(self, session) -> None:
        """`SessionHost`: a frame result was handled: the session may be quiescent."""
        if (replay := self.replays.get(session.id)) is not None:  # taken over: events due?
            replay.due(lambda: session.record.frames_answered, lambda: session.quiescent)
            if not replay.pending:
                del self.replays[session.id]
        if self.checkpoints is not None and self.draining:
            self._migrate(session.id)
        elif self.checkpoints is not None:
            self.checkpoints.maybe(session, frames_answered=session.record.frames_answered)

    def applied(self, session, event_text: str) -> None:
        """The session applied a client event (`event_text`): logged for a take-over."""
        if self.checkpoints is not None:
            self.checkpoints.applied(session, event_text, session.record.frames_answered)

    def moved(self, session_id: str) -> None:
        """Another server claimed the session (its client resumed there): end it here."""
        session = self.sessions.get(session_id)
        if session is None:
            return
        owner = self.owners.get(session_id)
        log.info("session %s: resumed on another server; ended here", session_id)
        if owner is not None:
            owner.hand_over()  # its connection still looked open
        self.remove(session, "moved")

    async def take_over(self, session_id: str, token: str | None,
                        api_key: str) -> Restored:
        """Claim a session another server held from the checkpoint store and open it here
        (`ResumeRefused`: no such checkpoint or token, or no room)."""
        if self.checkpoints is None:
            self.metrics.resume_attempt("refused_token")
            raise _no_session(session_id)
        claim = await self.checkpoints.claim(session_id, token, api_key)
        if claim is None:
            self.metrics.resume_attempt("refused_token")
            raise _no_session(session_id)
        try:
            restored = await self.checkpoints.restore(claim)
        except Exception:
            await self.checkpoints.unclaim(session_id, token, api_key)
            raise
        if restored is None:
            await self.checkpoints.unclaim(session_id, token, api_key)  # the token resumes it
            self.metrics.resume_attempt("refused_pool")
            raise ResumeRefused(503, ErrorCode.AT_CAPACITY, "this server's KV pool cannot "
                                "hold the session now; retry (the session stays resumable)",
                                error_type=ErrorType.SERVER)
        self.metrics.resume_attempt("restored")
        return restored

    # ---- leases and resumes (serve.resume) ------------------------------------------------
    def owns(self, session: AdmittedSession, owner: SessionOwner) -> bool:
        return self.owners.get(session.id) is owner

    def lease(self, session: AdmittedSession, resume_from_seq: int) -> bool:
        """The session's client dropped: hold it for the grace if it can be resumed (False:
        it cannot, and nothing changed; the caller removes it)."""
        if self.draining or not self.resumption.resumable(session.id):
            return False
        self.owners.pop(session.id, None)
        session.channel.detach(resume_from_seq,
                               lambda outcome: self._end_leased(session.id, outcome))
        self.resumption.lease(session.id, self.now_s())
        log.info("session %s: client dropped; held %g s for a resume", session.id,
                 self.resumption.grace_s)
        return True

    def _end_leased(self, session_id: str, outcome: str) -> None:
        session = self.sessions.get(session_id)
        if session is not None and session_id not in self.owners:
            log.info("session %s: lease ended (%s)", session_id, outcome)
            self.remove(session, outcome)

    def take_for_resume(self, session_id: str, token: str | None, api_key: str,
                        owner: SessionOwner) -> tuple[AdmittedSession, float]:
        """The session a resume continues, now `owner`'s, and how long its client was away
        (0: its old connection still looked open, and is told to hand it over); else
        `ResumeRefused`, with the same answer for an unknown session and a wrong token."""
        resumption, metrics = self.resumption, self.metrics
        if not resumption.enabled:
            metrics.resume_attempt("refused_off")
            raise ResumeRefused(404, ErrorCode.RESUME_REFUSED, "this server does not resume "
                                "sessions (--resume-grace-s 0)")
        if self.draining:
            metrics.resume_attempt("refused_draining")
            raise ResumeRefused(503, ErrorCode.SERVER_DRAINING, "this server is draining: "
                                "it resumes no session", error_type=ErrorType.SERVER)
        if not resumption.verify(session_id, token, api_key):
            metrics.resume_attempt("refused_token")
            raise _no_session(session_id)
        session = self.sessions[session_id]
        away_s = resumption.leased_for_s(session_id, self.now_s()) or 0.0
        previous = self.owners.get(session_id)
        self.owners[session_id] = owner
        if previous is not None:  # its old connection still looked open: it hands it over
            session.channel.detach(previous.hand_over(), lambda outcome: None)
        resumption.end_lease(session_id, "resumed")
        metrics.resume_attempt("resumed", away_s)
        return session, away_s

    def drain(self, timeout_s: float) -> None:
        """Take no new session from now on (refused as at capacity, reason `draining`), and
        close those still open after `timeout_s` (1001 going away); once set, for good."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: %d sessions open, %s, closed in %g s if still open",
                 len(self.sessions), "each moved to another server once it is between frames"
                 if self.checkpoints is not None else "none moved (no checkpoint store)",
                 timeout_s)
        self.driver.loop.call_later(timeout_s, self._drain_timeout)
        for session_id in list(self.owners):
            self._migrate(session_id)

    def _migrate(self, session_id: str) -> None:
        """Draining: checkpoint the connected session now if it is between frames, then
        close 4002 so its client resumes it elsewhere (else: at its next result)."""
        session, owner = self.sessions.get(session_id), self.owners.get(session_id)
        if (self.checkpoints is None or session is None or owner is None
                or session_id in self._migrating):
            return
        stored = self.checkpoints.maybe(session, force=True,
                                        frames_answered=session.record.frames_answered)
        if stored is None:
            return
        self._migrating.add(session_id)
        stored.add_done_callback(lambda done: self._migrated(session_id, done.result()))

    def _migrated(self, session_id: str, stored: bool) -> None:
        self._migrating.discard(session_id)
        session, owner = self.sessions.get(session_id), self.owners.get(session_id)
        if not stored or session is None or owner is None:
            return  # not checkpointed (unbounded, store full): closed at the drain timeout
        owner.migrate()
        self.remove(session, "migrated")
        self.metrics.session_migrated()

    def _drain_timeout(self) -> None:
        for owner in list(self.owners.values()):
            owner.go_away()
        for session_id in [s for s in self.sessions if s not in self.owners]:
            self._end_leased(session_id, "drained")

    # ---- SessionHost ----------------------------------------------------------------------
    @property
    def accepts_audio(self) -> bool:
        """The engine takes the audio front end's embeddings (vLLM's streaming input: not)."""
        return self.engine.accepts_embeddings

    def frontend(self, sample_rate_hz: int) -> AudioFrontEnd:
        if sample_rate_hz not in self._frontends:
            fmt = self.config.audio_format(sample_rate_hz)
            self._frontends[sample_rate_hz] = AudioFrontEnd.for_model(
                self.engine.model.embed_tokens, fmt) if self.accepts_audio else (
                AudioFrontEnd(fmt, hidden_size=1, embed_rms=1.0))  # framing only: never encodes
        return self._frontends[sample_rate_hz]

    def encode(self, work: Callable[[], T]) -> asyncio.Future[T]:
        """Run `work` (encoding audio, tokenizing text) on the encoder thread; its future
        resolves on the loop, futures in the order of the calls."""
        return self.driver.loop.run_in_executor(self._encoder, work)

    def detect(self, work: Callable[[SileroVad], T]) -> asyncio.Future[T]:
        """Run VAD `work` on the VAD thread with the shared Silero network; futures resolve
        on the loop in the order of the calls."""
        return self.driver.loop.run_in_executor(self._vad, lambda: work(self._silero_vad()))

    def _silero_vad(self) -> SileroVad:
        """On the VAD thread: the network, loaded by its first user (~0.1 s, off the loop)."""
        if self._silero is None:
            self._silero = SileroVad()
        return self._silero

    def cancel_frame(self, engine_session_id: int, index: int, reason: str) -> bool:
        return self.driver.beat.cancel_frame(engine_session_id, index, self.now_s(), reason)

    def open_session(self, profile: SessionProfile, public_id: str,
                     on_result: Callable[[FrameResult], None],
                     on_rebound: Callable[[Rebound], None]) -> int:
        return self.driver.beat.open_session(profile, self.now_s(), public_id, on_result,
                                             on_rebound)

    def adopt_session(self, profile: SessionProfile, public_id: str, engine_session_id: int,
                      on_result: Callable[[FrameResult], None],
                      on_rebound: Callable[[Rebound], None], frames_submitted: int,
                      bound: str | None) -> None:
        self.driver.beat.adopt_session(
            profile, engine_session_id, self.now_s(), public_id, on_result, on_rebound,
            frames_submitted, None if bound is None else ResidencyPolicy.parse(bound))

    def record(self, engine_session_id: int) -> SessionRecord:
        return self.driver.beat.sessions[engine_session_id]

    def close_session(self, engine_session_id: int) -> None:
        self.driver.beat.close_session(engine_session_id, self.now_s())
        self._probe()

    def accept(self, engine_session_id: int, num_tokens: int) -> Accepted:
        return self.driver.beat.accept(engine_session_id, num_tokens)

    def withdraw(self, accepted: Accepted) -> None:
        self.driver.beat.withdraw(accepted)

    def submit(self, frame: Frame, accepted: Accepted) -> None:
        self.driver.beat.submit_frame(frame, self.now_s(), accepted)

    def now_s(self) -> float:
        return self.driver.now_s()

    # ---- runtime listener -------------------------------------------------------------------
    def on_step(self, report) -> None:
        self.pool = report.pool
        self.resident_tokens = report.resident_tokens

    def _on_admission_update(self, sample: CapSample) -> None:
        self.metrics.set_admission_cap(sample.cap)
        self.metrics.set_admission_signal(sample.percentile / 100, sample.latency_fraction)
        self.observer.advance(sample.at_s)  # the health gauge recovers on an idle server too

    def _probe(self) -> None:
        """Read the pool on the engine thread after the commands queued so far (a close),
        so metrics show returned blocks at once, with no engine step to report them."""
        engine, loop = self.engine, self.driver.loop

        def read() -> None:
            pool, resident = engine.pool_stats(), engine.resident_tokens_by_session()
            with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
                loop.call_soon_threadsafe(self._on_probe, pool, resident)

        self.driver.call_on_engine(read)

    def _on_probe(self, pool: PoolStats, resident_tokens: dict[int, int]) -> None:
        self.pool = pool
        self.resident_tokens = resident_tokens
        # a close changes the forecast's sessions: re-forecast now, steps or not
        self.observer.observe_pool(self.now_s(), pool, resident_tokens, force=True)

    # ---- views ---------------------------------------------------------------------------
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
        return len(self.sessions) - len(self.owners)

    def session_list(self) -> dict:
        now_s = self.now_s()
        records = {r.public_id: r for r in self.driver.beat.sessions.values()}
        data = []
        for session in self.sessions.values():
            record = records.get(session.id)
            resident = None if record is None else self.resident_tokens.get(record.session_id)
            leased_for_s = self.resumption.leased_for_s(session.id, now_s)
            data.append(session.summary(now_s, resident) | {
                "connection": "connected" if leased_for_s is None else "leased",
                "lease_expires_in_s": None if leased_for_s is None else round(max(
                    0.0, self.resumption.grace_s - leased_for_s), 3)})
        return {"object": "list", "data": data, "kv_pool": vars(self.pool)}

    def close(self) -> None:
        self.loop_lag.stop()
        self.driver.close()
        self._encoder.shutdown(wait=False, cancel_futures=True)
        self._vad.shutdown(wait=False, cancel_futures=True)


def _no_session(session_id: str) -> ResumeRefused:
    return ResumeRefused(404, ErrorCode.RESUME_REFUSED, f"no resumable session {session_id!r} "
                         "with this token: it ended, its lease expired, the token is not its "
                         "latest (each resume issues a new one), or it was unbounded and its "
                         "server is gone (only bounded sessions are checkpointed)")


def _ceiling_policy(config: ServerConfig, engine: Engine) -> ResidencyPolicy:
    """The bound that sizes sessions for the memory ceiling: the server's, or, for unbounded
    sessions under graceful degradation, the bound they are switched to at the wall (so
    every admitted session fits once bound: none is ever stuck)."""
    policy = ResidencyPolicy.parse(config.policy)
    pressure = engine.config.pressure_policy
    return pressure if not policy.bounded and pressure is not None else policy
