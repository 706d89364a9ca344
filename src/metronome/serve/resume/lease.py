"""Resume tokens and leases: a session whose connection dropped is held for the grace.

A session whose client opted in to the extensions (`?metronome_events=true`) gets a resume
token in `session.created` (`session.metronome.resume`: `token`, `grace_s`) when the server
has a grace (`--resume-grace-s`, 0: off). If its socket then drops without a close frame
(a network loss: close 1006, a reset, a failed send), the session is not ended: it is
*leased* for the grace. Its KV stays resident, the frames it already submitted are answered
and their events kept (`realtime.emitter`), but its reply under way is cancelled where it got
to (a dropped client keeps no engine busy for the grace), no new frame is made (no input
comes), and admission still counts it. The lease is its peer's (`serve.edge.peers`): a
peer's dropped clients hold at most `--max-leases-per-peer` sessions, each counted against
its connections, and a session past that ends at once. Within the grace the client
reconnects to the same URL with `resume=<session id>` (and `last_event_id=<the last event
it received>`, optional) and the token (header `Metronome-Resume-Token`, or, from a
browser, the subprotocol `metronome-resume-token.<token>`). It gets
`metronome.session.resumed` (the session, with a new token: each token resumes once), then
every event it missed, in order, then the live ones; the conversation, the KV, the frame
numbering go on (a reply cut at the drop stays cut: the client asks again). A resume
while the old socket still looks open (a half-open TCP connection) takes the session over:
the old connection is closed 4001. After the grace the lease expires: the session ends and
every block goes back.

A token is 256 random bits, kept only as its SHA-256, compared in constant time (an unknown
session is compared against a dummy), and bound to its session and to the API key the
session was opened with. A session's grant (its credentials and its lease) is kept on the
session's resume state (`resume.state.ResumeState.grant`); `Resumption` issues and checks
them and runs the leases.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from metronome.observe.metrics import Metrics

RESUME_QUERY = "resume"  # ?resume=<session id>
LAST_EVENT_QUERY = "last_event_id"  # ?last_event_id=<the last server event received>
TOKEN_HEADER = "metronome-resume-token"
TOKEN_SUBPROTOCOL_PREFIX = "metronome-resume-token."
TAKEN_OVER_CLOSE_CODE = 4001  # the session was resumed on another connection
MIGRATED_CLOSE_CODE = 4002  # its server drains and checkpointed it: resume it (elsewhere)
MIGRATED_REASON = "session moved: resume it"
_DUMMY_DIGEST = hashlib.sha256(b"no such session").digest()  # an unknown session's


def offered_token(header: str | None, subprotocols: Iterable[str]) -> str | None:
    """The resume token a client offers: the header's, else a token subprotocol's."""
    if header:
        return header.strip()
    for subprotocol in subprotocols:
        if subprotocol.startswith(TOKEN_SUBPROTOCOL_PREFIX):
            return subprotocol[len(TOKEN_SUBPROTOCOL_PREFIX):]
    return None


def digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


@dataclass(frozen=True)
class Credentials:
    """What resumes one session, as kept: its current token's digest and its key's."""

    token_digest: bytes
    key_digest: bytes

    @classmethod
    def of(cls, token: str, api_key: str) -> Credentials:
        return cls(digest(token), digest(api_key))


def verify(credentials: Credentials | None, token: str | None, api_key: str) -> bool:
    """Constant time in the token, whether or not the session exists (None: unknown)."""
    expected = _DUMMY_DIGEST if credentials is None else credentials.token_digest
    token_ok = hmac.compare_digest(digest(token or ""), expected)
    key_ok = credentials is not None and hmac.compare_digest(digest(api_key),
                                                             credentials.key_digest)
    return token_ok and key_ok and token is not None


@dataclass
class Grant:
    """One session's credentials and lease."""

    credentials: Credentials
    leased_at_s: float | None = None  # None: connected
    expiry: asyncio.TimerHandle | None = None
    peer_slot: Releasable | None = None  # the lease, counted for its peer


class Releasable(Protocol):
    def release(self) -> None: ...


class Resumable(Protocol):
    """A session, as resumption sees it (`resume.state.ResumeState`)."""

    @property
    def id(self) -> str: ...

    grant: Grant | None  # None: it was never given a token


class Resumption:
    """The server's resume grants and leases; `expire(session, outcome)` ends a session
    whose lease ran out."""

    def __init__(self, grace_s: float, loop: asyncio.AbstractEventLoop, metrics: Metrics,
                 expire: Callable[[Resumable, str], None]) -> None:
        self.grace_s = grace_s
        self.loop = loop
        self.metrics = metrics
        self._expire = expire
        self.num_leased = 0

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    def grant(self, session: Resumable, api_key: str) -> str:
        """A new token for the session (its previous one, if any, no longer resumes it)."""
        assert self.enabled
        token = secrets.token_urlsafe(32)
        if session.grant is None:
            session.grant = Grant(Credentials.of(token, api_key))
        else:  # a resumed session's lease state stays as it is
            session.grant.credentials = Credentials.of(token, api_key)
        return token

    @staticmethod
    def verify(session: Resumable | None, token: str | None, api_key: str) -> bool:
        """Constant time in the token, whether or not the session exists (None: unknown)."""
        grant = None if session is None else session.grant
        return verify(None if grant is None else grant.credentials, token, api_key)

    @staticmethod
    def resumable(session: Resumable) -> bool:
        return session.grant is not None

    def lease(self, session: Resumable, now_s: float,
              peer_slot: Releasable | None = None) -> None:
        """The session's client dropped: hold it for the grace (counted for its peer by
        `peer_slot`, released when the lease ends), then expire it."""
        grant = session.grant
        assert grant is not None and grant.leased_at_s is None, session.id
        grant.leased_at_s = now_s
        grant.peer_slot = peer_slot
        grant.expiry = self.loop.call_later(self.grace_s, self._expire, session,
                                            "lease_expired")
        self.num_leased += 1
        self.metrics.set_sessions_leased(self.num_leased)

    @staticmethod
    def leased_for_s(session: Resumable, now_s: float) -> float | None:
        """How long the session has been leased; None: connected (or not resumable)."""
        grant = session.grant
        if grant is None or grant.leased_at_s is None:
            return None
        return now_s - grant.leased_at_s

    def end_lease(self, session: Resumable, outcome: str) -> None:
        """The leased session was resumed (or ended otherwise): stop its timer."""
        grant = session.grant
        if grant is None or grant.leased_at_s is None:
            return
        if grant.expiry is not None:
            grant.expiry.cancel()
        if grant.peer_slot is not None:
            grant.peer_slot.release()
        grant.leased_at_s = grant.expiry = grant.peer_slot = None
        self.num_leased -= 1
        assert self.num_leased >= 0, self.num_leased
        self.metrics.set_sessions_leased(self.num_leased)
        self.metrics.lease_ended(outcome)

    def forget(self, session: Resumable, outcome: str) -> None:
        """The session ended: its lease (if any) ends with `outcome`, its token with it."""
        self.end_lease(session, outcome)
        session.grant = None
