"""One session's server events, numbered and kept, on their way to its client's connection.

`EventLog` keeps the last `max_events` / `max_bytes` of them, so a client that resumes the
session (`serve.resume`) gets what it missed, in order. Every event the session emits gets
the next sequence number and joins the tail; the oldest fall out when either bound would
pass. While the session is detached (its client dropped: leased), the events from
`hold_from` on are owed to the client: evicting one of those would lose it, so the append
that would do it says so (`False`) and the session's keeper ends it instead (nothing is lost
silently). A resuming client names the last event it received (`last_event_id`); without
one, the server replays from the first event its old connection had not handed to the
transport.

`EventChannel` is the one way a session's events leave it: numbered and kept in its log,
then to the attached `Client` (the connection); while detached, only kept, and its `Keeper`
(the lease) hears when an owed event cannot be kept or the session fails.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from metronome.serve.protocol import ClientError, ServerEvent, text_bytes


class Client(Protocol):
    """The connection a session's events go to (`serve.connection.Connection`)."""

    def sink(self, event: ServerEvent, text: str, seq: int) -> None:
        """A session event, its JSON and its number in the session's stream of events."""

    def fail(self) -> None:
        """The session failed (a bug): the connection ends it (1011)."""

    def refuse(self, error: ClientError) -> None:
        """A client event the session refused: an `error` echoing its `event_id`."""


class Keeper(Protocol):
    """Who holds a detached session (its lease, `serve.resume`)."""

    def lost(self, outcome: str) -> None:
        """An event owed to the client cannot be kept (`lease_overflow`), or the session
        failed (`error`): end the session."""


@dataclass(frozen=True)
class MissedEvents:
    texts: list[str]  # the events to send again, oldest first
    first_seq: int  # the number of texts[0]
    missed_events: int  # owed but no longer held (0 unless the tail had to move on)


class EventLog:
    def __init__(self, max_events: int, max_bytes: int) -> None:
        assert max_events >= 1 and max_bytes >= 1, (max_events, max_bytes)
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.next_seq = 0  # the number the next event gets
        self.num_bytes = 0
        self._events: deque[tuple[str, str, int]] = deque()  # (event_id, text, bytes)
        self.hold_from: int | None = None  # detached: events from here on are owed

    @property
    def first_seq(self) -> int:
        """The number of the oldest event still held."""
        return self.next_seq - len(self._events)

    def append(self, event_id: str, text: str) -> bool:
        """Number and keep `text`; False when keeping it evicted an owed event (a lease that
        cannot be honoured). An event larger than `max_bytes` is kept alone."""
        size = text_bytes(text)
        self._events.append((event_id, text, size))
        self.next_seq += 1
        self.num_bytes += size
        kept = True
        while len(self._events) > 1 and (len(self._events) > self.max_events
                                         or self.num_bytes > self.max_bytes):
            if self.hold_from is not None and self.first_seq >= self.hold_from:
                kept = False  # the oldest is owed to a client that is away
            _, _, evicted = self._events.popleft()
            self.num_bytes -= evicted
        assert self.num_bytes >= 0 and len(self._events) <= max(1, self.max_events)
        return kept

    def seq_of(self, event_id: str) -> int | None:
        """The number of a held event, by its `event_id` (newest first: a resume names a
        recent one)."""
        for offset, (held_id, _, _) in enumerate(reversed(self._events)):
            if held_id == event_id:
                return self.next_seq - 1 - offset
        return None

    def since(self, seq: int) -> MissedEvents:
        """The held events numbered `seq` and later, and how many of those are gone."""
        seq = min(max(seq, 0), self.next_seq)
        start = max(seq, self.first_seq)
        skip = start - self.first_seq
        texts = [text for index, (_, text, _) in enumerate(self._events) if index >= skip]
        return MissedEvents(texts, start, start - seq)


class EventChannel:
    """Where one session's events go (see the module docstring)."""

    def __init__(self, log: EventLog, client: Client) -> None:
        self.log = log
        self._client: Client | None = client
        self._keeper: Keeper | None = None  # detached: the lease

    @property
    def attached(self) -> bool:
        return self._client is not None

    def emit(self, event: ServerEvent) -> None:
        text = event.to_json()
        kept = self.log.append(event.event_id, text)
        if self._client is not None:
            self._client.sink(event, text, self.log.next_seq - 1)
        elif not kept and self._keeper is not None:
            self._keeper.lost("lease_overflow")  # an event owed to the client would be lost

    def refuse(self, error: ClientError) -> None:
        """A client event refused: told to the attached client (a detached session's client
        is gone, and with it whatever it sent)."""
        if self._client is not None:
            self._client.refuse(error)

    def fail(self) -> None:
        """The session failed: its connection ends it, or, detached, its keeper."""
        if self._client is not None:
            self._client.fail()
        elif self._keeper is not None:
            self._keeper.lost("error")

    def detach(self, resume_from_seq: int, keeper: Keeper | None) -> None:
        """The client is gone: events from `resume_from_seq` on are owed to it; `keeper`
        (None: nobody) ends the session when one cannot be kept, or the session fails."""
        assert 0 <= resume_from_seq <= self.log.next_seq, (resume_from_seq,
                                                              self.log.next_seq)
        self._client, self._keeper = None, keeper
        self.log.hold_from = resume_from_seq

    def attach(self, client: Client, last_event_id: str | None) -> MissedEvents:
        """A resumed client: the events it missed (after `last_event_id` when the log
        still holds it, else from where its old connection stopped); `client` gets the
        rest."""
        assert self._client is None and self.log.hold_from is not None
        start = self.log.hold_from
        if last_event_id is not None:
            seq = self.log.seq_of(last_event_id)
            start = start if seq is None else seq + 1
        missed = self.log.since(start)
        self.log.hold_from = None
        self._client, self._keeper = client, None
        return missed
