"""Take-over: when a server checkpoints its sessions, logs their input, and continues a
session another server held (`resume.checkpoint` has the format and the store).

* **Checkpoints.** A session is checkpointed when it opens and then, after a frame result,
  at most once every `interval_s` (`--checkpoint-interval-s`), and only if something
  changed; a session not quiescent yet (an answer's tail still going into its context),
  still generating when the snapshot runs (a late frame's tokens), or checkpointed too
  recently is tried again at its next result or when the interval has passed, whichever
  comes first (no further result may come: a turn waits for its user). The loop captures
  the session's own state; the engine thread takes the engine snapshot (a copy of its
  blocks, ~1 ms: `Beat.snapshot`) as the next engine command, i.e. before any input the
  session sends afterwards; a worker thread serializes both (the MBs are copied neither on
  the loop nor on the engine thread). Unbounded sessions are never checkpointed (`engine.snapshot`
  refuses them).
* **The input log.** Every client event the session applies is numbered
  (`ResumeState.client_seq`) and, once the session has a checkpoint, appended to the
  store. Store calls of one session run in order, one at a time (`_Lane`), so an append
  never overtakes the put it follows; a server never awaits them on its loop, nor before
  an event applies (a round trip per audio chunk): events a server applied but had not
  logged when it died are not in the store. `metronome.session.resumed` says how many of
  its events the session holds (`client_events`, `last_client_event_id`): the client
  sends the rest again.
* **Moves.** A put or append the store refuses because another server claimed the session
  means the session lives there now: `on_moved` ends it here.
* **Take-over** (`restore`): a claimed checkpoint is opened in this engine (`Beat.restore`;
  its own pool: None when it cannot hold it) and the session rebuilt from it; the logged events are
  applied again, each at its place (`LoggedEvents`): every logged event carries how many
  frames the session had answered when it was first applied, and the new server applies it
  once the restored session has answered as many. So a client that waited for a response
  before its next message (the turn protocol: item, then `response.create`, then
  `response.done`, then the next item) is replayed exactly: every event lands after the
  replayed response it followed. Events the client sends on the new connection while a
  replay is pending queue behind it. (A duplex audio stream is replayed at the new server's
  pace: its frames are cut where the appends land there.)

A session's checkpointing state (its lane of store calls, its last checkpoint, a retry due)
is kept beside the session (`resume.state.ResumeState.checkpointing`, a `CheckpointState`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from metronome.engine.snapshot import SessionSnapshot, SnapshotError
from metronome.observe.metrics import Metrics
from metronome.runtime.beat import Beat, Snapshotted
from metronome.runtime.ports import Answer
from metronome.serve.resume.checkpoint import Checkpoint, CheckpointStore, Claim
from metronome.serve.resume.lease import Credentials, Grant
from metronome.stream import Stream

log = logging.getLogger(__name__)

StoreCall = Callable[[], Awaitable[object]]


class Checkpointable(Protocol):
    """What the checkpointer needs of a session (`resume.state.ResumeState`: the session and
    what resuming keeps of it)."""

    @property
    def id(self) -> str: ...

    client_seq: int  # client events applied

    @property
    def quiescent(self) -> bool: ...

    @property
    def stream(self) -> Stream:
        """Its frames answered."""

    @property
    def grant(self) -> Grant | None:
        """Its resume credentials (None: it cannot be resumed)."""

    checkpointing: CheckpointState

    def saved(self) -> dict: ...


@dataclass(frozen=True)
class Restored:
    saved: dict  # the session's own state, for `RealtimeSession(saved=...)`
    stream: Stream  # its stream, open in this engine
    events: list[tuple[int, str]]  # client events to replay, in order, each with the frames
    # the session had answered when it was first applied (`LoggedEvents`)
    client_seq: int  # the checkpoint's: the events replayed are numbered on from it


def _credentials(session: Checkpointable) -> Credentials | None:
    return None if session.grant is None else session.grant.credentials


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


@dataclass
class CheckpointState:
    """One session's checkpointing, kept on the session."""

    lane: _Lane | None = None  # its store calls, once a checkpoint was put (or queued)
    last: tuple[float, int, int] | None = None  # at_s, client_seq, frames answered
    never: bool = False  # unbounded: not checkpointed
    deferred: asyncio.TimerHandle | None = None  # a checkpoint due later
    migrating: bool = False  # draining: its checkpoint is under way, then it closes 4002


class Checkpointer:
    def __init__(self, store: CheckpointStore, owner: str, interval_s: float, beat: Beat,
                 metrics: Metrics, on_moved: Callable[[str], None],
                 now_s: Callable[[], float]) -> None:
        self.store = store
        self.owner = owner  # this server's name in the store
        self.interval_s = interval_s
        self.beat = beat  # snapshots and restores are its commands
        self.metrics = metrics
        self.on_moved = on_moved
        self.now_s = now_s

    # ---- checkpoints -----------------------------------------------------------------------
    def opened(self, session: Checkpointable) -> None:
        """A new session: its first checkpoint (it is quiescent: nothing sent yet)."""
        self.maybe(session, force=True)

    def maybe(self, session: Checkpointable, force: bool = False,
              frames_answered: int = 0) -> asyncio.Future | None:
        """Checkpoint `session` if it is quiescent, its interval has passed and it changed
        (or `force`: a drain's migration, a new session); the future resolves to True once
        the store holds it."""
        state = session.checkpointing
        if state.never or _credentials(session) is None:
            return None
        if not session.quiescent:  # e.g. an answer's tail still going into its context,
            if not force:  # which no result follows: try again when its interval has passed
                self._defer(session, self.interval_s)
            return None
        now_s = self.now_s()
        at_s, seq, frames = state.last or (-math.inf, -1, -1)
        if not force and (session.client_seq, frames_answered) == (seq, frames) and (
                state.lane is not None):
            return None  # nothing new since the last one
        if not force and now_s - at_s < self.interval_s:  # too soon: when it is due, if
            self._defer(session, at_s + self.interval_s - now_s)  # no result comes first
            return None
        state.last = (now_s, session.client_seq, frames_answered)
        # a deep copy now (KBs): the loop changes the session while a worker serializes
        saved, client_seq = json.loads(json.dumps(session.saved())), session.client_seq
        taken = self.beat.snapshot(session.stream)  # queued now: before any later input
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._lane(session).calls.put_nowait(
            lambda: self._put(session, taken, saved, client_seq, done))
        return done

    async def _put(self, session: Checkpointable, taken: Answer[Snapshotted], saved: dict,
                   client_seq: int, done: asyncio.Future) -> None:
        sid, stored, data, state = session.id, False, None, session.checkpointing
        seconds = 0.0
        try:
            snapshotted = await taken
        except SnapshotError:
            state.never = True  # unbounded: its resume elsewhere is refused
            self.metrics.checkpoint("unbounded")
        else:
            snapshot, seconds = snapshotted.snapshot, snapshotted.engine_s
            if snapshot.decode_budget > 0:  # still generating: its state is not the loop's
                state.last = None  # try again at its next result, or when its
                self.metrics.checkpoint("generating")  # interval has passed if none comes
                if state.lane is not None:
                    self._defer(session, self.interval_s)
            else:  # the MBs are copied on a worker thread: neither the loop nor the engine
                data = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: Checkpoint(saved, snapshot.to_bytes(), client_seq).to_bytes())
        credentials = _credentials(session)
        if data is not None and credentials is not None:
            stored = await self.store.put(sid, self.owner, data, client_seq, credentials)
            self.metrics.checkpoint("stored" if stored else "refused", len(data), seconds)
            if not stored:
                self.on_moved(sid)
        if not done.done():
            done.set_result(stored)

    def applied(self, session: Checkpointable, event_text: str, frames_answered: int) -> None:
        """`session` applied a client event (numbered already: `client_seq` counts it) with
        `frames_answered` frames answered: log it (with that count: `LoggedEvents`) once the
        session has a checkpoint."""
        seq = session.client_seq - 1
        if session.checkpointing.lane is not None:
            sid, owner, entry = session.id, self.owner, log_entry(frames_answered, event_text)
            self._lane(session).calls.put_nowait(lambda: self._append(sid, owner, seq, entry))

    async def _append(self, sid: str, owner: str, seq: int, event_text: str) -> None:
        if not await self.store.append(sid, owner, seq, event_text):
            self.on_moved(sid)

    def regranted(self, session: Checkpointable) -> None:
        """The session's resume token changed: the store checks the new one from now on."""
        credentials, sid = _credentials(session), session.id
        if session.checkpointing.lane is not None and credentials is not None:
            self._lane(session).calls.put_nowait(
                lambda: self.store.regrant(sid, self.owner, credentials))

    def _defer(self, session: Checkpointable, delay_s: float) -> None:
        """Try again in `delay_s`: a session quiet after its answer (a turn waiting for its
        user) is checkpointed then, not only at its next result, so a take-over replays
        from there instead of making that answer anew. One retry pending per session."""
        state = session.checkpointing
        if state.deferred is not None:
            return

        def due() -> None:
            state.deferred = None
            self.maybe(session, frames_answered=session.stream.frames_answered)

        state.deferred = asyncio.get_running_loop().call_later(delay_s, due)

    def ended(self, session: Checkpointable, keep: bool) -> None:
        """The session ended here: the store forgets it unless `keep` (it moves on: a drain
        migrates it, or another server claimed it)."""
        state, sid = session.checkpointing, session.id
        if state.deferred is not None:
            state.deferred.cancel()
        lane = state.lane
        session.checkpointing = CheckpointState()
        if lane is None:
            return
        if not keep:
            lane.calls.put_nowait(lambda: self.store.forget(sid, self.owner))
        lane.calls.put_nowait(None)

    @staticmethod
    def _lane(session: Checkpointable) -> _Lane:
        state = session.checkpointing
        if state.lane is None:
            state.lane = _Lane()
        return state.lane

    async def claimed_away(self, session: Checkpointable) -> bool:
        """Did another server take the session over (a local resume must not)?"""
        return session.checkpointing.lane is not None and await self.store.claimed_away(
            session.id, self.owner)

    # ---- take-over ---------------------------------------------------------------------------
    async def claim(self, session_id: str, token: str | None, api_key: str) -> Claim | None:
        return await self.store.claim(session_id, token, api_key, self.owner)

    async def unclaim(self, session_id: str, token: str | None, api_key: str) -> None:
        """A claim this server could not open (no room, or a snapshot it cannot load): the
        token the client offered resumes the session again, anywhere."""
        if token is not None:
            await self.store.regrant(session_id, self.owner, Credentials.of(token, api_key))

    async def restore(self, claim: Claim, make_stream: Callable[[dict], Stream]
                      ) -> Restored | None:
        """Open the claimed checkpoint in this engine as the stream `make_stream(saved state)`
        gives; None when its pool cannot hold it."""
        checkpoint = Checkpoint.from_bytes(claim.checkpoint)
        snapshot = SessionSnapshot.from_bytes(checkpoint.engine)
        stream = make_stream(checkpoint.state)
        if not await self.beat.restore(snapshot, stream):
            return None
        return Restored(checkpoint.state, stream, [read_entry(e) for e in claim.events],
                        checkpoint.client_seq)

    def adopted(self, session: Checkpointable, restored: Restored) -> None:
        """A session taken over here: its store entry is this server's now."""
        session.client_seq = restored.client_seq
        self._lane(session)  # its appends go on to the entry it was claimed from


# ---- the logged client events, applied again ---------------------------------------------
# apply(text, logged): logged events are in the store's log already; a live one is not
Apply = Callable[[str, bool], None]


def log_entry(frames_answered: int, event_text: str) -> str:
    """An event as the store's log keeps it."""
    return json.dumps([frames_answered, event_text])


def read_entry(entry: str) -> tuple[int, str]:
    frames_answered, event_text = json.loads(entry)
    return int(frames_answered), event_text


def held_events(client_seq: int, last_event_id: str | None,
                owed: list[str]) -> tuple[int, str | None]:
    """The client events a session holds, for `metronome.session.resumed`: the `client_seq`
    it applied (the last one's id `last_event_id`) and the `owed` ones a replay will apply;
    with the last one's `event_id`."""
    if owed:
        try:
            last = json.loads(owed[-1])
        except ValueError:  # a live event queued behind the replay, not parsed yet
            last = None
        last_event_id = last.get("event_id") if isinstance(last, dict) else None
    return client_seq + len(owed), last_event_id


class LoggedEvents:
    def __init__(self, logged: list[tuple[int, str]], apply: Apply) -> None:
        self.apply = apply
        self._queue: deque[tuple[int, str, bool]] = deque(
            (after, text, True) for after, text in logged)

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    @property
    def owed(self) -> list[str]:
        """The events still to apply, in order."""
        return [text for _, text, _ in self._queue]

    def offer(self, text: str) -> None:
        """A live event that arrived while the replay is pending: applied after it."""
        self._queue.append((-1, text, False))

    def due(self, frames_answered: Callable[[], int], quiescent: Callable[[], bool]) -> None:
        """Apply every queued event whose place the session has reached; and the next ones
        while the session is quiescent (no frame will come without input: a frame count
        the replay does not reproduce, e.g. audio cut into frames at another pace, must
        not hold the session's input back for good)."""
        while self._queue and (self._queue[0][0] <= frames_answered() or quiescent()):
            _, text, logged = self._queue.popleft()
            self.apply(text, logged)
