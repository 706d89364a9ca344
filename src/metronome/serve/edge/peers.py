"""Connections per peer: how many one peer holds open, and how fast it may open more.

A peer is one client address (an IPv6 client: its /64, which one host usually holds whole).
Each peer may hold `max_open` connections (WebSockets included, from connect to close) and
open new ones at `per_s` with bursts of `burst` (a token bucket); one past either is refused
before it is read (`serve.edge.guard` answers 503 or 429 with `Retry-After`). So one peer,
reconnecting as fast as it is dropped, holds at most `max_open` of the server's
`max_connections`, and every other peer (a real client, a health check) still gets in.

Behind a reverse proxy every connection comes from the proxy's address: its peers are read
from the forwarded-for header, and only for connections from `trusted_proxies` (a header
from anyone else is the client's own word, and ignored). Those connections are counted
once their headers are in, under the address the nearest trusted proxy saw (the rightmost
entry that is not itself a trusted proxy).

A session whose client dropped and that is held for a resume (a lease, `serve.resume`) is
the peer's too: a peer holds at most `max_leases` of them (one more is not held: the session
ends, its blocks go back), and each counts against its `max_open` connections until the
lease ends. So a peer that opens sessions and drops them holds no more of the server than
one that keeps them open.

Resume attempts (`?resume=` upgrades) take from a bucket of the peer's own
(`resumes_per_s`, `resume_burst`) as well as the server's (`serve.edge.guard.Door`): a
refused resume costs a parse of its headers and a 429, nothing more.

A peer's entry lives while it holds a connection or a lease or a bucket is refilling;
`PeerSlot` is one counted connection or lease, released once (a connection: its transport
closes, the WebSocket it became takes it over at the upgrade; a lease: it ends).
"""

from __future__ import annotations

import enum
import ipaddress
import math
from dataclasses import dataclass, field

from metronome.serve.edge.limits import PeerLimits
from metronome.serve.edge.rate_limit import TokenBucket

IPV6_PREFIX_BITS = 64
PRUNE_INTERVAL_S = 1.0  # idle peers are forgotten at most this often (a scan of the table)


class Refusal(enum.Enum):
    TOO_MANY_OPEN = "too_many_open"  # the peer holds `max_open` connections (leases included)
    TOO_FAST = "too_fast"  # the peer opened its burst above the rate
    TOO_MANY_LEASES = "too_many_leases"  # the peer's dropped clients hold `max_leases` sessions
    RESUMES_TOO_FAST = "resumes_too_fast"  # resume attempts past the peer's or server's rate

    @property
    def http_status(self) -> int:
        """The answer to a connection refused for this reason (a lease is no connection:
        503, should one ever be answered)."""
        return 429 if self in (Refusal.TOO_FAST, Refusal.RESUMES_TOO_FAST) else 503


@dataclass(frozen=True)
class Refused:
    reason: Refusal
    retry_after_s: int  # whole seconds, at least 1 (the `Retry-After` header)
    message: str


@dataclass
class _Peer:
    bucket: TokenBucket  # new connections
    resumes: TokenBucket
    num_open: int = 0
    num_leased: int = 0

    def holds_nothing(self, now_s: float) -> bool:
        for bucket in (self.bucket, self.resumes):
            bucket.refill(now_s)
        return (self.num_open == 0 and self.num_leased == 0
                and self.bucket.tokens >= self.bucket.burst
                and self.resumes.tokens >= self.resumes.burst)


@dataclass(eq=False)
class PeerSlot:
    """One open connection (or, `lease`, one held session) counted for `peer`; `release`
    gives it back (once)."""

    table: PeerTable
    peer: str
    lease: bool = False
    released: bool = field(default=False)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.table._release(self.peer, self.lease)


class PeerTable:
    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits
        self._peers: dict[str, _Peer] = {}
        self._pruned_at_s = 0.0

    def __len__(self) -> int:
        return len(self._peers)

    def num_open(self, peer: str) -> int:
        entry = self._peers.get(peer_key(peer))
        return 0 if entry is None else entry.num_open

    def num_leased(self, peer: str) -> int:
        entry = self._peers.get(peer_key(peer))
        return 0 if entry is None else entry.num_leased

    def _entry(self, peer: str, now_s: float) -> _Peer:
        entry = self._peers.get(peer)
        if entry is None:
            limits = self.limits
            entry = self._peers[peer] = _Peer(
                TokenBucket.full(limits.per_s, limits.burst, now_s),
                TokenBucket.full(limits.resumes_per_s, limits.resume_burst, now_s))
        return entry

    def open(self, address: str, now_s: float) -> PeerSlot | Refused:
        """Count a new connection from `address`, or say why it is refused."""
        self._prune(now_s)
        limits, peer = self.limits, peer_key(address)
        entry = self._entry(peer, now_s)
        if entry.num_open + entry.num_leased >= limits.max_open:
            held = (f" ({entry.num_leased} of them sessions held for a resume)"
                    if entry.num_leased else "")
            return Refused(Refusal.TOO_MANY_OPEN, 1, f"{limits.max_open} connections from "
                           f"your address are open{held}; close one or retry later")
        entry.bucket.refill(now_s)
        if not entry.bucket.holds(1):
            wait_s = (1 - entry.bucket.tokens) / limits.per_s
            return Refused(Refusal.TOO_FAST, max(1, math.ceil(wait_s)), f"more than "
                           f"{limits.per_s:g} new connections per second (burst "
                           f"{limits.burst}) from your address; slow down")
        entry.bucket.take(1)
        entry.num_open += 1
        return PeerSlot(self, peer)

    def hold_lease(self, peer: str, now_s: float) -> PeerSlot | Refused:
        """Count a session of `peer` (a key, `PeerSlot.peer`) held for a resume, or say why
        it is not held."""
        self._prune(now_s)
        entry = self._entry(peer, now_s)
        if entry.num_leased >= self.limits.max_leases:
            return Refused(Refusal.TOO_MANY_LEASES, 1, f"{self.limits.max_leases} sessions "
                           "of your address are already held for a resume")
        entry.num_leased += 1
        return PeerSlot(self, peer, lease=True)

    def take_resume(self, address: str, now_s: float) -> Refused | None:
        """One resume attempt from `address`: None, or refused (over the peer's rate)."""
        self._prune(now_s)
        limits = self.limits
        bucket = self._entry(peer_key(address), now_s).resumes
        bucket.refill(now_s)
        if not bucket.holds(1):
            wait_s = (1 - bucket.tokens) / limits.resumes_per_s
            return Refused(Refusal.RESUMES_TOO_FAST, max(1, math.ceil(wait_s)), f"more than "
                           f"{limits.resumes_per_s:g} resume attempts per second (burst "
                           f"{limits.resume_burst}) from your address; slow down")
        bucket.take(1)
        return None

    def is_trusted_proxy(self, address: str | None) -> bool:
        return address is not None and unmapped(address) in self.limits.trusted_proxies

    def forwarded_peer(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The client a trusted proxy forwarded (the rightmost forwarded-for entry that is
        not a trusted proxy), or None if the header is absent or names only proxies."""
        values = [value for name, value in headers if name == self.limits.forwarded_for_header]
        entries = [e.strip() for v in values for e in v.decode("latin-1").split(",")]
        for entry in reversed(entries):
            if entry and not self.is_trusted_proxy(entry):
                return entry
        return None

    def _release(self, peer: str, lease: bool) -> None:
        entry = self._peers[peer]
        if lease:
            assert entry.num_leased > 0, peer
            entry.num_leased -= 1
        else:
            assert entry.num_open > 0, peer
            entry.num_open -= 1

    def _prune(self, now_s: float) -> None:
        """Forget peers that hold nothing and whose buckets are full again: what they would
        get back is what a new entry gets."""
        if now_s - self._pruned_at_s < PRUNE_INTERVAL_S:
            return
        self._pruned_at_s = now_s
        for peer, entry in list(self._peers.items()):
            if entry.holds_nothing(now_s):
                del self._peers[peer]


def peer_key(address: str) -> str:
    """The peer an address belongs to: itself, or for IPv6 its /64 (an address that does
    not parse, e.g. a forwarded name, is its own peer)."""
    address = unmapped(address)
    if ":" not in address:
        return address
    try:
        return str(ipaddress.ip_network(f"{address}/{IPV6_PREFIX_BITS}", strict=False))
    except ValueError:
        return address


def unmapped(address: str) -> str:
    """`::ffff:a.b.c.d` (an IPv4 client on a dual-stack socket) as `a.b.c.d`; IPv6 in its
    compressed form; anything else as it is."""
    if ":" not in address:
        return address
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)
