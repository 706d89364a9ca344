"""The server's side of resuming: it grants tokens, leases a session whose client dropped,
resumes a session on a new connection (here, or taken over from another server's
checkpoint), and moves sessions off a draining server.

Owns the server's `Resumption` (`resume.lease`), with a checkpoint store its
`Checkpointer` (`resume.takeover`), and one `ResumeState` per admitted session (`states`,
by id: its connection, grant, checkpointing, replay, client events applied); the session
knows none of it, and tells it what it applies and settles through `SessionHooks`, which
the resumer implements. The connection knows none of this either: it asks `attach` for the
session a `?resume=` connection continues, and `lease` whether a dropped session is held;
everything here runs on the loop.

    new session    grant (a token for a client that opted in) -> opened (first checkpoint)
    dropped        lease: held for the grace, its events kept; expired: removed
    ?resume=id     attach: its lease ended, the missed events replayed (or claimed from the
                   store and restored, the logged client events replayed), then live
    drain          migrate: checkpointed between frames, closed 4002, resumed elsewhere
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from metronome.engine.types import EngineFeature
from metronome.kv.residency import ResidencyPolicy
from metronome.observe.metrics import Metrics
from metronome.runtime.wall import WallDriver
from metronome.serve import protocol as p
from metronome.serve.edge.peers import PeerSlot
from metronome.serve.edge.peers import Refused as PeerRefused
from metronome.serve.protocol import ErrorCode, ErrorType
from metronome.serve.protocol import server as se
from metronome.serve.protocol.errors import Refused
from metronome.serve.protocol.schema import ResumeOut
from metronome.serve.realtime.session import Host, RealtimeSession
from metronome.serve.realtime.settings import SessionSettings
from metronome.serve.resume.checkpoint import CheckpointStore
from metronome.serve.resume.lease import (
    LAST_EVENT_QUERY,
    MIGRATED_CLOSE_CODE,
    MIGRATED_REASON,
    TAKEN_OVER_CLOSE_CODE,
    TOKEN_HEADER,
    Grant,
    Resumable,
    Resumption,
    offered_token,
)
from metronome.serve.resume.state import Client, ResumeState
from metronome.serve.resume.takeover import Checkpointer, LoggedEvents, Restored, held_events
from metronome.stream import Stream

log = logging.getLogger(__name__)


POLICY_VIOLATION_CLOSE_CODE = 1008  # where the server cannot answer HTTP before the upgrade


class ResumeRefused(Refused):
    """A resume that cannot be honoured, answered before the upgrade with `http_status`."""

    def __init__(self, http_status: int, code: ErrorCode, message: str,
                 error_type: ErrorType = ErrorType.INVALID_REQUEST) -> None:
        super().__init__(http_status, POLICY_VIOLATION_CLOSE_CODE, "resume refused", code,
                         message, error_type)


class Server(Host, Protocol):
    """What resuming uses of its server (`serve.serving.Serving`) beside a session's needs."""

    @property
    def sessions(self) -> dict[str, RealtimeSession]: ...

    @property
    def draining(self) -> bool: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def driver(self) -> WallDriver:
        """The loop."""

    def add(self, session: RealtimeSession, connection: Client) -> None: ...

    def remove(self, session: RealtimeSession, outcome: str) -> None: ...


@dataclass(frozen=True)
class _Lease:
    """A leased session's keeper (`emitter.Keeper`): an event owed to its client that cannot
    be kept, or a failure, ends it."""

    resumer: Resumer
    session: RealtimeSession

    def lost(self, outcome: str) -> None:
        self.resumer.end_leased(self.session, outcome)


class Resumer:
    def __init__(self, serving: Server, store: CheckpointStore | None,
                 server_name: str) -> None:
        self.serving = serving
        config, driver = serving.config, serving.driver
        self.states: dict[str, ResumeState] = {}  # every admitted session's, by id
        self.resumption = Resumption(config.resume_grace_s, driver.loop, serving.metrics,
                                     self._expired)
        # Checkpoints to a store beyond this server (a cluster's), so another server resumes
        # a session this one held; they need resume tokens and the engine's snapshots.
        beat = serving.beat
        self.checkpoints = Checkpointer(
            store, server_name, config.checkpoint_interval_s, beat, serving.metrics,
            self.moved, serving.now_s) if (
            store is not None and config.checkpoint_interval_s > 0
            and self.resumption.enabled and beat.serves(EngineFeature.SNAPSHOT)) else None

    # ---- the sessions' states ----------------------------------------------------------------
    def admitted(self, session: RealtimeSession, connection: Client) -> ResumeState:
        """An admitted session, served on `connection`: its state from now on."""
        assert session.id not in self.states, session.id
        state = self.states[session.id] = ResumeState(session, connection)
        return state

    def state(self, session: RealtimeSession) -> ResumeState:
        return self.states[session.id]

    def connection_of(self, session: RealtimeSession) -> Client | None:
        """Its connection; None while it is leased (or once it ended)."""
        state = self.states.get(session.id)
        return None if state is None else state.connection

    def grant_of(self, session: RealtimeSession) -> Grant | None:
        """Its resume grant (None: never given a token, or it ended)."""
        state = self.states.get(session.id)
        return None if state is None else state.grant

    # ---- what a session tells (`SessionHooks`) ----------------------------------------------
    def received(self, session: RealtimeSession, text: str) -> bool:
        """A live client message: queued behind a take-over's replay while one is pending
        (the client sent it after all of them)."""
        state = self.states.get(session.id)  # (None: it ended, its connection with it)
        replay = None if state is None else state.replay
        if replay is not None and replay.pending:
            replay.offer(text)
            return True
        return False

    def applied(self, session: RealtimeSession, event: p.ClientEvent,
                text: str | None) -> None:
        """The session applied a client event: counted, and a live one (`text`) logged for a
        take-over (a replayed one was logged where it was first applied)."""
        state = self.states.get(session.id)
        if state is None:
            return  # it ended: nothing resumes it
        state.applied(event)
        if text is not None and self.checkpoints is not None:
            self.checkpoints.applied(state, text, session.stream.frames_answered)

    def settled(self, session: RealtimeSession) -> None:
        """A frame result of `session` was handled: a replay's events may be due, a
        checkpoint may be taken (or, draining, the session moved)."""
        state = self.states.get(session.id)
        if state is None:
            return  # ended: its last results come as it closes
        if (replay := state.replay) is not None:  # taken over: events due?
            replay.due(lambda: session.stream.frames_answered, lambda: session.quiescent)
            if not replay.pending:
                state.replay = None
        if self.checkpoints is not None and self.serving.draining:
            self.migrate(session)
        elif self.checkpoints is not None:
            self.checkpoints.maybe(state, frames_answered=session.stream.frames_answered)

    # ---- a session's life ------------------------------------------------------------------
    def grant(self, session: RealtimeSession, client: Client) -> None:
        """A new resume token for a client that can read it (it opted in to the extensions)."""
        if self.resumption.enabled and session.extensions:
            state = self.states[session.id]
            session.resume_offer = ResumeOut(
                token=self.resumption.grant(state, client.api_key),
                grace_s=self.resumption.grace_s)
            if self.checkpoints is not None:
                self.checkpoints.regranted(state)

    def opened(self, session: RealtimeSession) -> None:
        """A new session has started: resumable elsewhere from here on."""
        if self.checkpoints is not None and session.resume_offer is not None:
            self.checkpoints.opened(self.states[session.id])

    def ended(self, session: RealtimeSession, outcome: str) -> None:
        """The session ended here: its state goes, its lease and token with it; its
        checkpoint stays in the store if it moved on (claimed by another server, or migrated
        by a drain)."""
        state = self.states.pop(session.id, None)
        if state is None:
            return
        state.replay = state.connection = None
        self.resumption.forget(state, outcome)
        if self.checkpoints is not None:
            self.checkpoints.ended(state, keep=outcome in ("moved", "migrated"))

    # ---- a dropped client -----------------------------------------------------------------
    def lease(self, session: RealtimeSession, resume_from_seq: int,
              hold_for_peer: Callable[[float], PeerSlot | PeerRefused | None] | None = None
              ) -> bool:
        """The session's client dropped: hold it for the grace if it can be resumed and its
        peer may hold one more (`hold_for_peer`, the connection's `hold_lease`; False: it
        cannot, and nothing changed; the caller removes it). A held session stops
        generating: its reply under way is cancelled (its events up to there kept for the
        resume), so a dropped client keeps no engine busy for the grace."""
        state = self.states[session.id]
        if self.serving.draining or not self.resumption.resumable(state):
            return False
        now_s = self.serving.now_s()
        held = None if hold_for_peer is None else hold_for_peer(now_s)
        if isinstance(held, PeerRefused):
            log.info("session %s: client dropped; not held for a resume: %s", session.id,
                     held.message)
            self.serving.metrics.lease_refused()
            return False
        state.connection = None
        session.channel.detach(resume_from_seq, _Lease(self, session))
        self.resumption.lease(state, now_s, held)
        session.stop_generating()
        log.info("session %s: client dropped; held %g s for a resume", session.id,
                 self.resumption.grace_s)
        return True

    def _expired(self, state: Resumable, outcome: str) -> None:
        """A lease ran out (`Resumption`)."""
        session = self.serving.sessions.get(state.id)
        if session is not None:
            self.end_leased(session, outcome)

    def end_leased(self, session: RealtimeSession, outcome: str) -> None:
        if self.serving.sessions.get(session.id) is session and (
                self.connection_of(session) is None):
            log.info("session %s: lease ended (%s)", session.id, outcome)
            self.serving.remove(session, outcome)

    # ---- a resuming client ----------------------------------------------------------------
    async def attach(self, session_id: str, client: Client
                     ) -> tuple[RealtimeSession, Callable[[], None]]:
        """The session a `?resume=` connection continues, now `client`'s, and what to do once
        the connection is accepted; else `ResumeRefused` (the same answer for an unknown
        session and a wrong token)."""
        arrived_s = self.serving.driver.loop.time()
        token = offered_token(client.header(TOKEN_HEADER), client.subprotocols)
        serving, checkpoints = self.serving, self.checkpoints
        if checkpoints is not None and self.resumption.enabled and not serving.draining:
            here = serving.sessions.get(session_id)
            if here is not None and await checkpoints.claimed_away(self.states[here.id]):
                self.moved(session_id)  # resumed on another server since: not here
            if session_id not in serving.sessions:
                return await self._take_over(session_id, token, client, arrived_s)
        session, away_s = self.take_for_resume(session_id, token, client)

        def resumed() -> None:
            missed = session.channel.attach(client, client.query(LAST_EVENT_QUERY))
            client.attached_seq = missed.first_seq
            self.grant(session, client)
            state = self.states[session.id]
            owed = [] if state.replay is None else state.replay.owed
            held, last_id = held_events(state.client_seq, state.last_client_event_id, owed)
            client.send(se.MetronomeSessionResumed(
                session=session.describe(), resumed=se.ResumedOut(
                    away_s=round(away_s, 3), replayed_events=len(missed.texts),
                    missed_events=missed.missed_events, client_events=held,
                    last_client_event_id=last_id)))
            for offset, text in enumerate(missed.texts):
                client.send_numbered(text, missed.first_seq + offset)
            serving.metrics.observe_resume(serving.driver.loop.time() - arrived_s)
            log.info("session %s resumed after %.3f s: %d events replayed, %d missed",
                     session.id, away_s, len(missed.texts), missed.missed_events)

        return session, resumed

    def take_for_resume(self, session_id: str, token: str | None, client: Client
                         ) -> tuple[RealtimeSession, float]:
        """The session a resume continues here, now `client`'s, and how long its client was
        away (0: its old connection still looked open, and is told to hand it over)."""
        resumption, metrics, serving = self.resumption, self.serving.metrics, self.serving
        if not resumption.enabled:
            metrics.resume_attempt("refused_off")
            raise ResumeRefused(404, ErrorCode.RESUME_REFUSED, "this server does not resume "
                                "sessions (--resume-grace-s 0)")
        if serving.draining:
            metrics.resume_attempt("refused_draining")
            raise ResumeRefused(503, ErrorCode.SERVER_DRAINING, "this server is draining: "
                                "it resumes no session", error_type=ErrorType.SERVER)
        session = serving.sessions.get(session_id)
        state = None if session is None else self.states[session_id]
        if not resumption.verify(state, token, client.api_key):
            metrics.resume_attempt("refused_token")
            raise _no_session(session_id)
        assert session is not None and state is not None
        away_s = resumption.leased_for_s(state, serving.now_s()) or 0.0
        previous, state.connection = state.connection, client
        if previous is not None:  # its old connection still looked open: it hands it over
            resume_from = previous.resume_from()
            previous.end("handed_over", TAKEN_OVER_CLOSE_CODE, "session resumed on another "
                         "connection", flush=False)
            session.channel.detach(resume_from, None)
        if resumption.leased_for_s(state, serving.now_s()) is not None:
            session.resume_generating()
        resumption.end_lease(state, "resumed")
        metrics.resume_attempt("resumed", away_s)
        return session, away_s

    async def _take_over(self, session_id: str, token: str | None, client: Client,
                         arrived_s: float) -> tuple[RealtimeSession, Callable[[], None]]:
        """A session another server held: claimed from the store, opened here from its
        checkpoint, its client's events since replayed; the client gets
        `metronome.session.resumed` (`from_checkpoint`), then the events the replay makes
        (they supersede what it had after the checkpoint), then the live ones."""
        serving = self.serving
        checkpoints = self.checkpoints
        assert checkpoints is not None
        restored = await self._claim(session_id, token, client.api_key)
        saved = restored.saved
        session = RealtimeSession(serving, client, saved["extensions"], saved=saved,
                                  stream=restored.stream)
        serving.add(session, client)
        state = self.states[session.id]
        state.load(saved)
        checkpoints.adopted(state, restored)
        client.attached_seq = session.channel.log.next_seq  # its channel is the client's

        def resumed() -> None:
            self.grant(session, client)
            held, last_id = held_events(state.client_seq, state.last_client_event_id,
                                        [text for _, text in restored.events])
            client.send(se.MetronomeSessionResumed(
                session=session.describe(), resumed=se.ResumedOut(
                    away_s=0.0, replayed_events=0, missed_events=0, from_checkpoint=True,
                    replayed_client_events=len(restored.events), client_events=held,
                    last_client_event_id=last_id)))
            replay = LoggedEvents(restored.events, session.apply)
            replay.due(lambda: session.stream.frames_answered,  # the rest after replayed
                       lambda: session.quiescent)  # frames
            if replay.pending:
                state.replay = replay
            serving.metrics.observe_resume(serving.driver.loop.time() - arrived_s)
            log.info("session %s taken over from a checkpoint: %d client events replayed",
                     session.id, len(restored.events))

        return session, resumed

    async def _claim(self, session_id: str, token: str | None, api_key: str) -> Restored:
        """Claim a session another server held from the checkpoint store and open its stream
        here (`ResumeRefused`: no such checkpoint or token, or no room)."""
        checkpoints, metrics = self.checkpoints, self.serving.metrics
        if checkpoints is None:
            metrics.resume_attempt("refused_token")
            raise _no_session(session_id)
        claim = await checkpoints.claim(session_id, token, api_key)
        if claim is None:
            metrics.resume_attempt("refused_token")
            raise _no_session(session_id)
        try:
            restored = await checkpoints.restore(claim, self._stream_of)
        except Exception:
            await checkpoints.unclaim(session_id, token, api_key)
            raise
        if restored is None:
            await checkpoints.unclaim(session_id, token, api_key)  # the token resumes it
            metrics.resume_attempt("refused_pool")
            raise ResumeRefused(503, ErrorCode.AT_CAPACITY, "this server's KV pool cannot "
                                "hold the session now; retry (the session stays resumable)",
                                error_type=ErrorType.SERVER)
        metrics.resume_attempt("restored")
        return restored

    def _stream_of(self, saved: dict) -> Stream:
        """The stream of a session saved elsewhere (`RealtimeSession.saved`): its profile,
        its frame numbering and the bound KV pressure imposed on it."""
        serving = self.serving
        mode = SessionSettings.load(saved["settings"]).mode
        stream = Stream(saved["id"], serving.config.profile(mode),
                        serving.now_s() - saved["age_s"])
        stream.frames_submitted = saved["frames_submitted"]
        stream.bound = None if saved["bound"] is None else ResidencyPolicy.parse(saved["bound"])
        return stream

    def moved(self, session_id: str) -> None:
        """Another server claimed the session (its client resumed there): end it here."""
        session = self.serving.sessions.get(session_id)
        if session is None:
            return
        log.info("session %s: resumed on another server; ended here", session_id)
        connection = self.connection_of(session)
        if connection is not None:  # its connection still looked open
            connection.end("handed_over", TAKEN_OVER_CLOSE_CODE,
                           "session resumed on another connection", flush=False)
        self.serving.remove(session, "moved")

    # ---- a draining server --------------------------------------------------------------
    def migrate(self, session: RealtimeSession) -> None:
        """Draining: checkpoint the connected session now if it is between frames, then
        close 4002 so its client resumes it elsewhere (else: at its next result)."""
        state = self.states.get(session.id)
        if (self.checkpoints is None or state is None or state.connection is None
                or state.checkpointing.migrating
                or self.serving.sessions.get(session.id) is not session):
            return
        stored = self.checkpoints.maybe(state, force=True,
                                        frames_answered=session.stream.frames_answered)
        if stored is None:
            return
        state.checkpointing.migrating = True
        stored.add_done_callback(lambda done: self._migrated(session, state, done.result()))

    def _migrated(self, session: RealtimeSession, state: ResumeState, stored: bool) -> None:
        state.checkpointing.migrating = False
        connection = state.connection
        if not stored or self.serving.sessions.get(session.id) is not session or (
                connection is None):
            return  # not checkpointed (unbounded, store full): closed at the drain timeout
        connection.end("migrated", MIGRATED_CLOSE_CODE, MIGRATED_REASON)
        self.serving.remove(session, "migrated")
        self.serving.metrics.session_migrated()

    def describe(self, session: RealtimeSession, now_s: float) -> dict:
        """Its connection as `GET /v1/sessions` shows it: connected, or leased (for how
        much longer)."""
        leased_for_s = self.resumption.leased_for_s(self.states[session.id], now_s)
        return {"connection": "connected" if leased_for_s is None else "leased",
                "lease_expires_in_s": None if leased_for_s is None else round(max(
                    0.0, self.resumption.grace_s - leased_for_s), 3)}


def _no_session(session_id: str) -> ResumeRefused:
    return ResumeRefused(404, ErrorCode.RESUME_REFUSED, f"no resumable session {session_id!r} "
                         "with this token: it ended, its lease expired, the token is not its "
                         "latest (each resume issues a new one), or it was unbounded and its "
                         "server is gone (only bounded sessions are checkpointed)")

