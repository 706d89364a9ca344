"""The cluster's session store: checkpoints of bounded sessions (`serve.resume.checkpoint`) kept
beyond any replica, so a session resumes on a survivor after its replica is killed or
drained (`serve.resume.takeover`).

Why a Ray actor and not Redis: the cluster already runs on Ray, whose head node outlives
every replica; a detached named actor (`STORE_NAME`, no CPU of its own) holds the
checkpoints in its memory, and a checkpoint travels to it as one call's argument (Ray moves
a large argument through its object store: no copy through the caller's loop). A Redis
would be one more service to install, secure and keep alive for the same guarantee. The
limit is the same as the board's: the actor lives on the head node, so losing the head
loses the store (and the cluster with it); `--session-store-bytes` bounds its memory.

`RayCheckpointStore` is the replica's side: `serve.resume.checkpoint.CheckpointStore` over the
actor's handle (each call awaited on the replica's loop, never blocking it).
"""

from __future__ import annotations

import ray

from metronome.cluster.board import NAMESPACE
from metronome.serve.resume.checkpoint import CheckpointShelf, Claim
from metronome.serve.resume.lease import Credentials

STORE_NAME = "metronome-session-store"


class SessionStoreActor:
    """`CheckpointShelf` as a Ray actor: calls run one at a time, in each caller's order."""

    def __init__(self, expire_after_s: float, max_bytes: int) -> None:
        self.shelf = CheckpointShelf(expire_after_s, max_bytes)

    def put(self, session_id: str, owner: str, checkpoint: bytes | bytearray, client_seq: int,
            grant: Credentials) -> bool:
        return self.shelf.put(session_id, owner, checkpoint, client_seq, grant)

    def append(self, session_id: str, owner: str, seq: int, event: str) -> bool:
        return self.shelf.append(session_id, owner, seq, event)

    def regrant(self, session_id: str, owner: str, grant: Credentials) -> bool:
        return self.shelf.regrant(session_id, owner, grant)

    def claim(self, session_id: str, token: str | None, api_key: str,
              owner: str) -> Claim | None:
        return self.shelf.claim(session_id, token, api_key, owner)

    def forget(self, session_id: str, owner: str) -> None:
        self.shelf.forget(session_id, owner)

    def claimed_away(self, session_id: str, owner: str) -> bool:
        return self.shelf.claimed_away(session_id, owner)

    def describe(self, session_id: str) -> dict | None:
        return self.shelf.describe(session_id)

    def stats(self) -> dict:
        return {"sessions": len(self.shelf), "bytes": self.shelf.num_bytes}


def store_handle(expire_after_s: float, max_bytes: int):
    """The store actor, created by whoever asks first (launcher or replica)."""
    return ray.remote(SessionStoreActor).options(
        name=STORE_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0).remote(expire_after_s, max_bytes)


class RayCheckpointStore:
    """`CheckpointStore` on the store actor."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def put(self, session_id, owner, checkpoint, client_seq, grant) -> bool:
        return await self.handle.put.remote(session_id, owner, checkpoint, client_seq, grant)

    async def append(self, session_id, owner, seq, event) -> bool:
        return await self.handle.append.remote(session_id, owner, seq, event)

    async def regrant(self, session_id, owner, grant) -> bool:
        return await self.handle.regrant.remote(session_id, owner, grant)

    async def claim(self, session_id, token, api_key, owner) -> Claim | None:
        return await self.handle.claim.remote(session_id, token, api_key, owner)

    async def forget(self, session_id, owner) -> None:
        await self.handle.forget.remote(session_id, owner)

    async def claimed_away(self, session_id, owner) -> bool:
        return await self.handle.claimed_away.remote(session_id, owner)
