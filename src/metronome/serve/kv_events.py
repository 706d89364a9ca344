"""Server events about a session's KV bound: a `metronome.*` extension beside the events of
`serve.server_events`, in the same shape (`ServerEvent`: an `event_id`, a `type`), sent only
to a client that opted in (`?metronome_events=true`).

`metronome.session.resumed`: the first event on a connection that resumed the session
(`serve.resume`): the session (with the next resume token), how long the client was away,
and how many events follow that it missed (then the live ones).

`metronome.session.bounded`: the server's opt-in graceful degradation (`degrade_policy`)
switched this unbounded session to a sinks+window bound because the KV pool ran dry. Its
middle blocks went back to the pool; from now on it attends to its sinks and its window
only, and it keeps its beat instead of stalling.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from metronome.serve.protocol import ServerEvent
from metronome.serve.session_schema import SessionOut


class BoundOut(BaseModel):
    policy: str  # the bound now in force, e.g. sinks_window:4:512@absolute
    reason: Literal["kv_pressure"] = "kv_pressure"
    freed_blocks: int  # returned to the pool when it was bound
    resident_kv_tokens: int  # the session's live KV right after


class MetronomeSessionBounded(ServerEvent):
    type: Literal["metronome.session.bounded"] = "metronome.session.bounded"
    session_id: str
    bound: BoundOut


class ResumedOut(BaseModel):
    away_s: float  # since the old connection dropped (0: it was taken over while open)
    replayed_events: int  # the missed events that follow, in order
    missed_events: int  # owed but no longer held (the session's event stream moved on)
    # Taken over on another server from its last checkpoint (`serve.checkpointing`): the
    # events that follow are made anew by replaying the client's events since the checkpoint
    # (`replayed_client_events`); they supersede what the client had after the checkpoint.
    from_checkpoint: bool = False
    replayed_client_events: int = 0
    # The client's events the session holds, counted in the order sent (events answered
    # with an `error` are not counted; events still queued behind a take-over's replay
    # are), and the last one's `event_id` (None: it had none, or a checkpoint older than
    # this field): any the client sent after that one never reached the session (lost
    # with the connection, or with a server that died before logging them): send them
    # again. Match on the id (give events unique ids); the count is the fallback.
    client_events: int = 0
    last_client_event_id: str | None = None


class MetronomeSessionResumed(ServerEvent):
    type: Literal["metronome.session.resumed"] = "metronome.session.resumed"
    session: SessionOut
    resumed: ResumedOut
