"""What the transport bounds, as plain values: the client door's (`TransportLimits`, enforced by
`serve.edge.guard` before any handler runs) and each peer's (`PeerLimits`, `serve.edge.peers`).

Only values live here, so the server's config (`serve.config`) builds them without importing
the guard's uvicorn protocols.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeerLimits:
    max_open: int  # connections one peer may hold open
    per_s: float  # new connections per second, per peer
    burst: int  # new connections a peer may open at once above the rate
    trusted_proxies: frozenset[str] = frozenset()  # addresses whose forwarded-for is read
    forwarded_for_header: bytes = b"x-forwarded-for"
    max_leases: int = 16  # sessions a peer's dropped clients may have held for a resume
    resumes_per_s: float = 1.0  # resume attempts per second, per peer
    resume_burst: int = 8  # resume attempts a peer may make at once above that rate


@dataclass(frozen=True)
class TransportLimits:
    request_timeout_s: float
    max_header_bytes: int
    max_connections: int
    pings_per_s: float  # WebSocket pings, pongs and continuation frames, per connection
    ping_burst: int
    peers: PeerLimits
    near_cap_fraction: float = 0.75  # of max_connections open: new ones get a short deadline
    near_cap_handshake_s: float = 1.0  # that deadline, for the first request's headers
    resumes_per_s: float = 20.0  # resume attempts per second, the whole server
    resume_burst: int = 40
    health_max_connections: int = 16  # the health listener's own budget
