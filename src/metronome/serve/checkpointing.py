"""When a server checkpoints its sessions, logs their input, and takes over one another
server held (`serve.checkpoint` has the format and the store).

* **Checkpoints.** A session is checkpointed when it opens and then, after a frame result,
  at most once every `interval_s` (`--checkpoint-interval-s`), and only if something
  changed; a session not quiescent yet (an answer's tail still going into its context),
  still generating when the snapshot runs (a late frame's tokens), or checkpointed too
  recently is tried again at its next result or when the interval has passed, whichever
  comes first (no further result may come: a turn waits for its user). The loop captures
  the session's own state; the engine thread takes the engine snapshot (a copy of its
  blocks, ~1 ms) as the next engine command, i.e. before any input the session sends
  afterwards; a worker thread serializes both (the MBs are copied neither on the loop nor
  on the engine thread). Unbounded sessions are never checkpointed (`engine.snapshot`
  refuses them).
* **The input log.** Every client event the session applies is numbered
  (`RealtimeSession.client_seq`) and, once the session has a checkpoint, appended to the
  store. Store calls of one session run in order, one at a time (`_Lane`), so an append
  never overtakes the put it follows; a server never awaits them on its loop, nor before
  an event applies (a round trip per audio chunk): events a server applied but had not
  logged when it died are not in the store. `metronome.session.resumed` says how many of
  its events the session holds (`client_events`, `last_client_event_id`): the client
  sends the rest again.
* **Moves.** A put or append the store refuses because another server claimed the session
  means the session lives there now: `on_moved` ends it here.
* **Take-over** (`restore`): a claimed checkpoint is opened in this engine (its own pool:
  None when it cannot hold it) and the session rebuilt from it; the caller replays the
  logged events, each at its place (`serve.replay`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from metronome.engine.snapshot import SessionSnapshot, SnapshotError
from metronome.observe.metrics import Metrics
from metronome.runtime.record import SessionRecord
from metronome.serve.checkpoint import Checkpoint, CheckpointStore, Claim
from metronome.serve.replay import log_entry, read_entry
from metronome.serve.resume import Credentials
from metronome.serve.session_checkpoint import saved_state

log = logging.getLogger(__name__)

StoreCall = Callable[[], Awaitable[object]]


class Checkpointable:
    """What the checkpointer needs of a session (`serve.session.RealtimeSession`)."""

    id: str
    engine_session_id: int
    client_seq: int
    quiescent: bool
    record: SessionRecord  # frames answered


@dataclass(frozen=True)
class Restored:
    saved: dict  # the session's own state, for `RealtimeSession(saved=...)`
    engine_session_id: int
    events: list[tuple[int, str]]  # client events to replay, in order, each with the frames
    # the session had answered when it was first applied (`serve.replay`)
    client_seq: int  # the checkpoint's: the events replayed are numbered on from it


class _Lane:
    """One session's store calls, in order, one at a time."""

    def __init__(self) -> None:
        self.calls: asyncio.Queue[StoreCall | None] = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while (call := await self.calls.get()) is not None:
            try:
                await call()
            except Exception:  # the store unreachable: this call is lost, the next may not be
                log.warning("checkpoint store call failed", exc_info=True)


class Checkpointer:
    def __init__(self, store: CheckpointStore, owner: str, interval_s: float, engine,
                 run_on_engine: Callable[[Callable], asyncio.Future],
                 credentials: Callable[[str], Credentials | None], metrics: Metrics,
                 on_moved: Callable[[str], None], now_s: Callable[[], float]) -> None:
        self.store = store
        self.owner = owner  # this server's name in the store
        self.interval_s = interval_s
        self.engine = engine
        self.run_on_engine = run_on_engine
        self.credentials = credentials
        self.metrics = metrics
        self.on_moved = on_moved
        self.now_s = now_s
        self._lanes: dict[str, _Lane] = {}  # sessions with a checkpoint put (or queued)
        self._last: dict[str, tuple[float, int, int]] = {}  # at_s, client_seq, frames
        self._never: set[str] = set()  # unbounded: not checkpointed
        self._deferred: dict[str, asyncio.TimerHandle] = {}  # a checkpoint due later

    # ---- checkpoints -----------------------------------------------------------------------
    def opened(self, session: Checkpointable) -> None:
        """A new session: its first checkpoint (it is quiescent: nothing sent yet)."""
        self.maybe(session, force=True)

    def maybe(self, session: Checkpointable, force: bool = False,
              frames_answered: int = 0) -> asyncio.Future | None:
        """Checkpoint `session` if it is quiescent, its interval has passed and it changed
        (or `force`: a drain's migration, a new session); the future resolves to True once
        the store holds it."""
        sid = session.id
        if sid in self._never or self.credentials(sid) is None:
            return None
        if not session.quiescent:  # e.g. an answer's tail still going into its context,
            if not force:  # which no result follows: try again when its interval has passed
                self._defer(session, self.interval_s)
            return None
        now_s = self.now_s()
        at_s, seq, frames = self._last.get(sid, (-math.inf, -1, -1))
        if not force and (session.client_seq, frames_answered) == (seq, frames) and (
                sid in self._lanes):
            return None  # nothing new since the last one
        if not force and now_s - at_s < self.interval_s:  # too soon: when it is due, if
            self._defer(session, at_s + self.interval_s - now_s)  # no result comes first
            return None
        self._last[sid] = (now_s, session.client_seq, frames_answered)
        # a deep copy now (KBs): the loop changes the session while a worker serializes
        saved, client_seq = json.loads(json.dumps(saved_state(session))), session.client_seq
        engine, engine_sid = self.engine, session.engine_session_id

        def take() -> tuple[SessionSnapshot | None, float]:  # engine thread, between steps
            start = time.perf_counter()
            snapshot = engine.snapshot_session(engine_sid)  # a copy: serialized elsewhere
            if snapshot.decode_budget > 0:
                return None, 0.0  # still generating: its state is not the loop's
            return snapshot, time.perf_counter() - start

        taken = self.run_on_engine(take)  # queued now: before any later input
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._lane(sid).calls.put_nowait(
            lambda: self._put(session, taken, saved, client_seq, done))
        return done

    async def _put(self, session: Checkpointable, taken: asyncio.Future, saved: dict,
                   client_seq: int, done: asyncio.Future) -> None:
        sid, stored, data = session.id, False, None
        try:
            snapshot, seconds = await taken
        except SnapshotError:
            self._never.add(sid)  # unbounded: its resume elsewhere is refused
            self.metrics.checkpoint("unbounded")
        else:
            if snapshot is None:
                self._last.pop(sid, None)  # try again at its next result, or when its
                self.metrics.checkpoint("generating")  # interval has passed if none comes
                if sid in self._lanes:
                    self._defer(session, self.interval_s)
            else:  # the MBs are copied on a worker thread: neither the loop nor the engine
                data = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: Checkpoint(saved, snapshot.to_bytes(), client_seq).to_bytes())
        credentials = self.credentials(sid)
        if data is not None and credentials is not None:
            stored = await self.store.put(sid, self.owner, data, client_seq, credentials)
            self.metrics.checkpoint("stored" if stored else "refused", len(data), seconds)
            if not stored:
                self.on_moved(sid)
        if not done.done():
            done.set_result(stored)

    def applied(self, session: Checkpointable, event_text: str, frames_answered: int) -> None:
        """`session` applied a client event (numbered already: `client_seq` counts it) with
        `frames_answered` frames answered: log it (with that count: `serve.replay`) once the
        session has a checkpoint."""
        seq = session.client_seq - 1
        if session.id in self._lanes:
            sid, owner, entry = session.id, self.owner, log_entry(frames_answered, event_text)
            self._lane(sid).calls.put_nowait(lambda: self._append(sid, owner, seq, entry))

    async def _append(self, sid: str, owner: str, seq: int, event_text: str) -> None:
        if not await self.store.append(sid, owner, seq, event_text):
            self.on_moved(sid)

    def regranted(self, session_id: str) -> None:
        """The session's resume token changed: the store checks the new one from now on."""
        credentials = self.credentials(session_id)
        if session_id in self._lanes and credentials is not None:
            self._lane(session_id).calls.put_nowait(
                lambda: self.store.regrant(session_id, self.owner, credentials))

    def _defer(self, session: Checkpointable, delay_s: float) -> None:
        """Try again in `delay_s`: a session quiet after its answer (a turn waiting for its
        user) is checkpointed then, not only at its next result, so a take-over replays
        from there instead of making that answer anew. One retry pending per session."""
        if session.id in self._deferred:
            return

        def due() -> None:
            self._deferred.pop(session.id, None)
            self.maybe(session, frames_answered=session.record.frames_answered)

        self._deferred[session.id] = asyncio.get_running_loop().call_later(delay_s, due)

    def ended(self, session_id: str, keep: bool) -> None:
        """The session ended here: the store forgets it unless `keep` (it moves on: a drain
        migrates it, or another server claimed it)."""
        if (deferred := self._deferred.pop(session_id, None)) is not None:
            deferred.cancel()
        lane = self._lanes.pop(session_id, None)
        self._last.pop(session_id, None)
        self._never.discard(session_id)
        if lane is None:
            return
        if not keep:
            lane.calls.put_nowait(lambda: self.store.forget(session_id, self.owner))
        lane.calls.put_nowait(None)

    def _lane(self, sid: str) -> _Lane:
        lane = self._lanes.get(sid)
        if lane is None:
            lane = self._lanes[sid] = _Lane()
        return lane

    async def claimed_away(self, session_id: str) -> bool:
        """Did another server take the session over (a local resume must not)?"""
        return session_id in self._lanes and await self.store.claimed_away(session_id,
                                                                           self.owner)

    # ---- take-over ---------------------------------------------------------------------------
    async def claim(self, session_id: str, token: str | None, api_key: str) -> Claim | None:
        return await self.store.claim(session_id, token, api_key, self.owner)

    async def unclaim(self, session_id: str, token: str | None, api_key: str) -> None:
        """A claim this server could not open (no room, or a snapshot it cannot load): the
        token the client offered resumes the session again, anywhere."""
        if token is not None:
            await self.store.regrant(session_id, self.owner, Credentials.of(token, api_key))

    async def restore(self, claim: Claim) -> Restored | None:
        """Open the claimed checkpoint in this engine; None when its pool cannot hold it."""
        checkpoint = Checkpoint.from_bytes(claim.checkpoint)
        snapshot = SessionSnapshot.from_bytes(checkpoint.engine)
        engine = self.engine
        engine_sid = await self.run_on_engine(lambda: engine.restore_session(snapshot))
        if engine_sid is None:
            return None
        return Restored(checkpoint.state, engine_sid, [read_entry(e) for e in claim.events],
                        checkpoint.client_seq)

    def adopted(self, session: Checkpointable, restored: Restored) -> None:
        """A session taken over here: its store entry is this server's now."""
        session.client_seq = restored.client_seq
        self._lane(session.id)  # its appends go on to the entry it was claimed from
