"""A Realtime session's checkpoint, and the store that keeps checkpoints beyond a server.

A checkpoint is everything a server needs to continue a bounded session that another server
held: the engine session's snapshot (`engine.snapshot`: resident KV, positions, pending
input, sampler) and the Realtime session's own state (settings, conversation items, frame
numbering, audio framing and encoder context, the text decoder's held tokens, the event
numbering), taken together at a *quiescent* moment: no frame of the session accepted,
waiting, in flight or still generating, no input queued. Then the loop-side state and the
engine-side state describe the same instant (engine commands run in order: anything the
session sends later is queued behind the snapshot).

Every client event the session applies after the checkpoint is logged to the store with
its number (`client_seq`), so a server that loads the checkpoint replays them through the
same code path and the session continues token-exact (greedy sampling; a seeded sampler's
state is in the snapshot). The store drops the logged events a newer checkpoint covers.

The store is shared (`CheckpointStore`): `MemoryCheckpointStore` in one process (two
servers in a test), `cluster.session_store` on Ray, owned by a detached actor that outlives
any replica. It checks a resume's token itself, in constant time, against the token's and
the API key's SHA-256 (`resume.lease`), so a claim with a wrong token changes nothing. A
session has one owner at a time: a claim moves it to the claiming server, and the old
owner's later writes are refused (a replica that was only slow, not dead, stops there).

    checkpoint = Checkpoint(state, engine_bytes, client_seq)
    store.put(session_id, owner, checkpoint.to_bytes(), client_seq, credentials)
    store.append(session_id, owner, seq, event_json)
    claim = store.claim(session_id, token, api_key, new_owner)   # None: refused
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from metronome.envelope import Envelope
from metronome.serve.resume.lease import Credentials, verify


class CheckpointError(ValueError):
    """Bytes that are not a checkpoint this server reads."""


ENVELOPE = Envelope(b"METRONOME-CHECKPOINT", 1, "Metronome session checkpoint",
                    CheckpointError)


@dataclass(frozen=True)
class Checkpoint:
    state: dict  # the Realtime session's (`RealtimeSession.saved_state`), JSON
    engine: bytes | bytearray  # `SessionSnapshot.to_bytes()`
    client_seq: int  # client events the session had applied when it was taken

    def to_bytes(self) -> bytearray:
        """The envelope (`metronome.envelope`): the session's state as the JSON header, the
        engine's snapshot as the payload (copied once, into the buffer)."""
        out, start = ENVELOPE.seal({"state": self.state, "client_seq": self.client_seq},
                                   len(self.engine))
        out[start:] = self.engine
        return out

    @classmethod
    def from_bytes(cls, data: bytes | bytearray) -> Checkpoint:
        header, start = ENVELOPE.open(data)
        return cls(header["state"], bytearray(data[start:]), header["client_seq"])


@dataclass(frozen=True)
class Claim:
    """What a claiming server continues from: the checkpoint and the events after it."""

    checkpoint: bytes | bytearray
    events: list[str]  # client events applied after the checkpoint, in order
    owner_before: str  # the server that held the session


class CheckpointStore(Protocol):
    """Async: a server awaits none of `put`/`append`/`forget` on its loop (it schedules
    them); `claim` is awaited by the resume that needs it."""

    async def put(self, session_id: str, owner: str, checkpoint: bytes | bytearray, client_seq: int,
                  grant: Credentials) -> bool: ...

    async def append(self, session_id: str, owner: str, seq: int, event: str) -> bool: ...

    async def regrant(self, session_id: str, owner: str, grant: Credentials) -> bool: ...

    async def claim(self, session_id: str, token: str | None, api_key: str,
                    owner: str) -> Claim | None: ...

    async def forget(self, session_id: str, owner: str) -> None: ...

    async def claimed_away(self, session_id: str, owner: str) -> bool: ...


@dataclass
class _Entry:
    owner: str
    grant: Credentials
    checkpoint: bytes | bytearray
    client_seq: int
    events: list[tuple[int, str]] = field(default_factory=list)  # (seq, event) after it
    touched_s: float = 0.0
    resumable: bool = True  # False from a claim (its token spent) to the new owner's grant


class CheckpointShelf:
    """The store's logic, synchronous: one per store (`MemoryCheckpointStore` wraps it for
    one process, the cluster's actor for Ray). Entries not touched for `expire_after_s`
    (a server died and nobody resumed within the grace) are dropped; at most `max_bytes`
    of checkpoints are kept (a put that would pass it is refused: the session is simply
    not resumable elsewhere until a later put fits)."""

    def __init__(self, expire_after_s: float, max_bytes: int,
                 clock=time.monotonic) -> None:
        self.expire_after_s = expire_after_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self.num_bytes = 0

    def put(self, session_id: str, owner: str, checkpoint: bytes | bytearray, client_seq: int,
            grant: Credentials) -> bool:
        self._expire()
        entry = self._entries.get(session_id)
        if entry is not None and entry.owner != owner:
            return False  # claimed by another server since
        old_bytes = 0 if entry is None else len(entry.checkpoint)
        if self.num_bytes - old_bytes + len(checkpoint) > self.max_bytes:
            return False
        if entry is None:
            entry = self._entries[session_id] = _Entry(owner, grant, checkpoint, client_seq)
        entry.checkpoint, entry.client_seq, entry.grant = checkpoint, client_seq, grant
        entry.resumable = True
        entry.events = [(seq, e) for seq, e in entry.events if seq >= client_seq]
        entry.touched_s = self.clock()
        self.num_bytes += len(checkpoint) - old_bytes
        assert self.num_bytes == sum(len(e.checkpoint) for e in self._entries.values())
        return True

    def append(self, session_id: str, owner: str, seq: int, event: str) -> bool:
        entry = self._entries.get(session_id)
        if entry is None or entry.owner != owner:
            return False  # never checkpointed (not resumable elsewhere), or claimed since
        if seq >= entry.client_seq:
            assert not entry.events or entry.events[-1][0] < seq, (entry.events[-1][0], seq)
            entry.events.append((seq, event))
        entry.touched_s = self.clock()
        return True

    def regrant(self, session_id: str, owner: str, grant: Credentials) -> bool:
        entry = self._entries.get(session_id)
        if entry is None or entry.owner != owner:
            return False
        entry.grant, entry.touched_s, entry.resumable = grant, self.clock(), True
        return True

    def claim(self, session_id: str, token: str | None, api_key: str,
              owner: str) -> Claim | None:
        """The session's checkpoint and log, now `owner`'s; None (nothing changed) for an
        unknown session or a wrong token or key, alike and in constant time."""
        self._expire()
        entry = self._entries.get(session_id)
        if not verify(None if entry is None else entry.grant, token, api_key):
            return None
        assert entry is not None
        claim = Claim(entry.checkpoint, [event for _, event in entry.events], entry.owner)
        entry.owner, entry.touched_s, entry.resumable = owner, self.clock(), False
        # the token is spent: nothing resumes the session until its new owner regrants
        entry.grant = Credentials(secrets.token_bytes(32), entry.grant.key_digest)
        return claim

    def claimed_away(self, session_id: str, owner: str) -> bool:
        """Has another server claimed the session `owner` checkpointed?"""
        entry = self._entries.get(session_id)
        return entry is not None and entry.owner != owner

    def forget(self, session_id: str, owner: str) -> None:
        entry = self._entries.get(session_id)
        if entry is not None and entry.owner == owner:
            self._drop(session_id)

    def __len__(self) -> int:
        return len(self._entries)

    def describe(self, session_id: str) -> dict | None:
        """A stored session's owner, checkpoint size, log and whether a token resumes it
        now (None: not stored, or expired)."""
        self._expire()
        entry = self._entries.get(session_id)
        return None if entry is None else {
            "owner": entry.owner, "checkpoint_bytes": len(entry.checkpoint),
            "client_seq": entry.client_seq, "logged_events": len(entry.events),
            "resumable": entry.resumable}

    def _expire(self) -> None:
        now_s = self.clock()
        for session_id in [s for s, e in self._entries.items()
                           if now_s - e.touched_s > self.expire_after_s]:
            self._drop(session_id)

    def _drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id)
        self.num_bytes -= len(entry.checkpoint)


class MemoryCheckpointStore:
    """`CheckpointStore` in this process, for servers that share it (each on its own loop
    and thread: tests, one host)."""

    def __init__(self, expire_after_s: float = 60.0, max_bytes: int = 1 << 30) -> None:
        self.shelf = CheckpointShelf(expire_after_s, max_bytes)
        self._lock = threading.Lock()

    async def put(self, session_id, owner, checkpoint, client_seq, grant) -> bool:
        with self._lock:
            return self.shelf.put(session_id, owner, checkpoint, client_seq, grant)

    async def append(self, session_id, owner, seq, event) -> bool:
        with self._lock:
            return self.shelf.append(session_id, owner, seq, event)

    async def regrant(self, session_id, owner, grant) -> bool:
        with self._lock:
            return self.shelf.regrant(session_id, owner, grant)

    async def claim(self, session_id, token, api_key, owner) -> Claim | None:
        with self._lock:
            return self.shelf.claim(session_id, token, api_key, owner)

    async def forget(self, session_id, owner) -> None:
        with self._lock:
            self.shelf.forget(session_id, owner)

    async def claimed_away(self, session_id, owner) -> bool:
        with self._lock:
            return self.shelf.claimed_away(session_id, owner)
