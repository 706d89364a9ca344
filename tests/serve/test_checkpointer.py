"""When `serve.resume.takeover.Checkpointer` takes a session's checkpoint, on a virtual clock with
a fake engine and session: a session that becomes quiescent, or stops generating, without a
frame result after it (an answer's tail still going into its context; a turn waiting for
its user) is still checkpointed once its interval has passed. CI caught the first: the
answer's last result found 17 tokens of its tail queued, no result followed, and the
session was never checkpointed after its answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

from metronome.observe.metrics import Metrics
from metronome.runtime.beat import Snapshotted
from metronome.serve.resume.checkpoint import MemoryCheckpointStore
from metronome.serve.resume.lease import Credentials, Grant
from metronome.serve.resume.takeover import Checkpointer, CheckpointState

INTERVAL_S = 0.05


@dataclass
class FakeSession:
    id: str = "sess_1"
    client_seq: int = 0
    quiescent: bool = True
    stream: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(frames_answered=0))
    grant: Grant = field(default_factory=lambda: Grant(Credentials.of("token", "key")))
    checkpointing: CheckpointState = field(default_factory=CheckpointState)

    def saved(self) -> dict:
        """The fake session has no Realtime state to save: the checkpoint carries `{}`."""
        return {}


class FakeEngine:
    def __init__(self) -> None:
        self.decode_budget = 0
        self.snapshots = 0

    def snapshot_session(self, session_id: str):
        self.snapshots += 1
        return SimpleNamespace(decode_budget=self.decode_budget, to_bytes=lambda: b"kv" * 8)


def _checkpointer(store: MemoryCheckpointStore, engine: FakeEngine) -> Checkpointer:
    loop = asyncio.get_running_loop()

    def snapshot(stream):  # `Beat.snapshot`: the engine's, answered at once
        future = loop.create_future()
        future.set_result(Snapshotted(engine.snapshot_session("sess_1"), 0.0))
        return future

    return Checkpointer(store, "a", INTERVAL_S, SimpleNamespace(snapshot=snapshot), Metrics(),
                        on_moved=lambda sid: None, now_s=loop.time)


async def _stored_seq(store: MemoryCheckpointStore, session: FakeSession, seq: int) -> bool:
    """Whether the store holds a checkpoint taken after `seq` client events within 1 s."""
    for _ in range(100):
        entry = store.shelf.describe(session.id)
        if entry is not None and entry["client_seq"] >= seq:
            return True
        await asyncio.sleep(0.01)
    return False


async def _opened():
    """A new session, its opening checkpoint stored: store, engine, session, checkpointer."""
    store, engine, session = MemoryCheckpointStore(), FakeEngine(), FakeSession()
    checkpoints = _checkpointer(store, engine)
    checkpoints.opened(session)
    assert await _stored_seq(store, session, 0)
    return store, engine, session, checkpoints


def test_a_session_quiescent_only_after_its_last_result_is_checkpointed_later():
    async def scenario():
        store, engine, session, checkpoints = await _opened()
        session.client_seq, session.stream.frames_answered = 2, 2  # asked and answered...
        session.quiescent = False  # ... but its answer's tail is still queued
        await asyncio.sleep(INTERVAL_S)  # not too soon: only the quiescence declines it
        assert checkpoints.maybe(session, frames_answered=2) is None
        session.quiescent = True  # the tail went in; no result tells the checkpointer
        assert await _stored_seq(store, session, 2)
        checkpoints.ended(session, keep=False)

    asyncio.run(scenario())


def test_a_session_still_generating_at_the_snapshot_is_checkpointed_once_it_stopped():
    async def scenario():
        store, engine, session, checkpoints = await _opened()
        session.client_seq = 2
        engine.decode_budget = 3  # a late frame's tokens: the snapshot is not taken
        await asyncio.sleep(INTERVAL_S)
        assert await checkpoints.maybe(session, frames_answered=2) is False
        engine.decode_budget = 0  # it finished; no result follows
        assert await _stored_seq(store, session, 2)
        checkpoints.ended(session, keep=False)

    asyncio.run(scenario())


def test_an_ended_session_is_not_tried_again():
    async def scenario():
        store, engine, session, checkpoints = await _opened()
        session.quiescent = False
        await asyncio.sleep(INTERVAL_S)
        checkpoints.maybe(session, frames_answered=1)
        snapshots = engine.snapshots
        checkpoints.ended(session, keep=False)  # cancels the retry
        session.quiescent = True
        await asyncio.sleep(3 * INTERVAL_S)
        assert engine.snapshots == snapshots and store.shelf.describe(session.id) is None

    asyncio.run(scenario())
