"""Ray Serve's request router for the replicas: new sessions by admission headroom.

Ray Serve (2.60) runs one router per handle, in its proxy for HTTP and WebSocket ingress;
each routing call asks `choose_replicas` for ranks of replicas and, within the first rank
that has one, takes the replica with the shortest queue (`max_ongoing_requests` is set high
enough never to bind: a WebSocket holds its slot for the whole session). Replicas report
their room through `record_routing_stats` (`cluster.replica`), which Serve's controller
calls every `request_routing_stats_period_s` and hands to this router as
`RunningReplica.routing_stats`. The ranking itself is `cluster.headroom.rank`.

Every request is ranked the same way (an HTTP request is cheap anywhere); only sessions are
counted as placements. The proxy names a request's route by matching it against the app's
HTTP routes only, so a WebSocket's route is the application's prefix: that is a session
(so is a request for a path the app does not have, which its next report corrects).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from metronome.cluster.headroom import ReplicaRoom, rank

ROUTER_PATH = "metronome.cluster.router.HeadroomRouter"  # RequestRouterConfig's class
APP_ROUTE_PREFIX = "/"  # the application's (cluster.launch)
PLACEMENTS_KEPT = 256  # per replica: far more than one stats period places

log = logging.getLogger("ray.serve")  # Ray Serve's logger: its proxy writes it out


class HeadroomRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, route_prefix: str = APP_ROUTE_PREFIX, **kwargs) -> None:
        self._route_prefix = route_prefix
        self._placed_at_s: dict[ReplicaID, deque[float]] = {}
        log.info("metronome: placing sessions by admission headroom (%s)", ROUTER_PATH)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        rooms = {rid: ReplicaRoom.from_stats(r.routing_stats) for rid, r in by_id.items()}
        ranks = rank(rooms, self._placed_at_s)
        return [[by_id[rid] for rid in ids] for ids in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        if pending_request.metadata.route in (self._route_prefix, ""):  # a WebSocket
            placed = self._placed_at_s.setdefault(replica_id, deque(maxlen=PLACEMENTS_KEPT))
            placed.append(time.time())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._placed_at_s.pop(replica_id, None)
