"""What resuming keeps of one admitted session, beside the session (which knows none of it).

    connection       the connection it is served on; None while it is leased
    grant            its resume token's digest and its lease (`lease.Grant`)
    checkpointing    its lane of store calls, its last checkpoint, a retry due
    replay           a take-over's client events still to apply (`takeover.LoggedEvents`)
    client_seq       the client events it applied (a checkpoint's log numbers them), the
                     last one's id

A checkpoint of the session is its parts' own `saved()` (`RealtimeSession.saved`) and this
state's (`saved`); the resumer holds one `ResumeState` per admitted session, by id, from its
admission to its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from metronome.serve import protocol as p
from metronome.serve.edge.peers import PeerSlot
from metronome.serve.edge.peers import Refused as PeerRefused
from metronome.serve.protocol import ClientError
from metronome.serve.protocol import server as se
from metronome.serve.realtime.session import RealtimeSession
from metronome.serve.resume.lease import Grant
from metronome.serve.resume.takeover import CheckpointState, LoggedEvents
from metronome.stream import Stream


class Client(Protocol):
    """A session's connection, as the server uses it (`serve.connection.Connection`)."""

    @property
    def api_key(self) -> str:
        """The key it was authorized with ("" for a server without one)."""

    attached_seq: int  # the first session event it was to deliver
    subprotocols: list[str]

    @property
    def extensions(self) -> bool:
        """It takes `metronome.*` events."""

    def query(self, name: str) -> str | None: ...

    def header(self, name: str) -> str | None: ...

    def sink(self, event: p.ServerEvent, text: str, seq: int) -> None:
        """The session's events, numbered."""

    def fail(self) -> None: ...

    def refuse(self, error: ClientError) -> None: ...

    def send(self, event: se.ServerEvent) -> None:
        """A connection's own event (not in the session's numbered stream)."""

    def send_numbered(self, text: str, seq: int) -> None: ...

    def resume_from(self) -> int:
        """The first session event it did not hand to the transport."""

    def hold_lease(self, now_s: float) -> PeerSlot | PeerRefused | None:
        """Its session held for its peer (`serve.edge.peers`), or why not; None: no peer."""

    def end(self, outcome: str, code: int | None, reason: str,
            error: ClientError | None = None, flush: bool = True) -> None: ...


@dataclass(eq=False)
class ResumeState:
    session: RealtimeSession
    connection: Client | None  # None: leased (its client dropped)
    grant: Grant | None = None  # None: it was never given a token
    checkpointing: CheckpointState = field(default_factory=CheckpointState)
    replay: LoggedEvents | None = None
    client_seq: int = 0  # client events applied
    last_client_event_id: str | None = None  # the last one's

    # ---- what the checkpointer reads (`takeover.Checkpointable`) ---------------------------------
    @property
    def id(self) -> str:
        return self.session.id

    @property
    def quiescent(self) -> bool:
        return self.session.quiescent

    @property
    def stream(self) -> Stream:
        return self.session.stream

    def saved(self) -> dict:
        """The session's parts' state and this one's, for a checkpoint."""
        return self.session.saved() | {"last_client_event_id": self.last_client_event_id}

    def load(self, saved: dict) -> None:
        self.last_client_event_id = saved.get("last_client_event_id")  # older checkpoints

    def applied(self, event: p.ClientEvent) -> None:
        """The session applied `event`: counted."""
        self.client_seq += 1
        self.last_client_event_id = event.event_id
