"""Placement by admission headroom: which replica a new session goes to (pure, no Ray).

A replica reports its room (`ReplicaRoom`: its controller's effective cap, its active
sessions, whether it is healthy, when it measured) every stats period. Between reports the
router counts the sessions it placed itself after the report was taken, so a burst of new
sessions is spread instead of piling onto the replica that looked emptiest at the last
report. Ranks, best first:

    healthy with room, most room first (ties share a rank) ─► no report yet ─► healthy and
    full ─► unhealthy

Full and unhealthy replicas stay in the last ranks, never dropped: when every replica is
full, the session still reaches one, whose admission refuses it as the plain server does
(HTTP 503 + Retry-After), instead of waiting in the router for room that may never come.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class ReplicaRoom:
    cap: int  # the admission controller's effective cap (AIMD cap within the memory ceiling)
    active: int  # sessions admitted and open
    healthy: bool  # no engine error, not draining
    at_s: float  # wall clock (time.time()) when measured

    def to_stats(self) -> dict:
        return {"cap": self.cap, "active": self.active, "healthy": self.healthy,
                "at_s": self.at_s}

    @classmethod
    def from_stats(cls, stats: Mapping) -> ReplicaRoom | None:
        """None for a replica that has not reported yet (Ray Serve gives `{}`)."""
        if not stats or "cap" not in stats:
            return None
        return cls(int(stats["cap"]), int(stats["active"]), bool(stats["healthy"]),
                   float(stats["at_s"]))


def headroom(room: ReplicaRoom, placed_at_s: Iterable[float]) -> int:
    """Sessions the replica still takes: its cap less its sessions, less those placed on
    it since it measured (the report does not count them yet)."""
    since = sum(1 for t in placed_at_s if t >= room.at_s)
    return room.cap - room.active - since


def rank(rooms: Mapping[K, ReplicaRoom | None],
         placed_at_s: Mapping[K, Iterable[float]]) -> list[list[K]]:
    """The replicas in ranks, best first (see the module docstring); every replica is in
    one rank."""
    with_room: dict[int, list[K]] = {}
    unknown, full, unhealthy = [], [], []
    for key, room in rooms.items():
        if room is None:
            unknown.append(key)
        elif not room.healthy:
            unhealthy.append(key)
        else:
            left = headroom(room, placed_at_s.get(key, ()))
            (with_room.setdefault(left, []) if left > 0 else full).append(key)
    ranks = [with_room[left] for left in sorted(with_room, reverse=True)]
    return [r for r in ranks + [unknown, full, unhealthy] if r]
