"""One cluster replica: the whole Realtime server (`serve.app.create_app`) as a Ray Serve
ingress deployment, with its own engine, beat, admission controller and metrics.

Ray Serve builds the app in the replica (`__serve_build_asgi_app__`) and runs its lifespan
there, so the engine and its threads live in the replica's process. Beside the plain
server's routes the replica serves `GET /v1/cluster` (every replica, from the board), labels
every metric with `replica`, reports its admission headroom to the router each stats period
(`record_routing_stats`, which also feeds the board) and fails Ray's health check once its
engine has failed, so Ray replaces it.
"""

from __future__ import annotations

import os
import time

import ray
import torch
from fastapi import FastAPI
from ray import serve

from metronome.cluster.board import BOARD_NAME, ClusterBoard
from metronome.cluster.config import ClusterConfig
from metronome.cluster.headroom import ReplicaRoom
from metronome.observe.labelled_registry import LabelledRegistry
from metronome.serve.app import create_app
from metronome.serve.config import ServerConfig
from metronome.serve.state import ServerState

CLUSTER_PATH = "/v1/cluster"
NAMESPACE = "metronome"  # the board's Ray namespace
FORGET_AFTER_S = 60.0  # a replica gone this long leaves /v1/cluster


def board_handle(cluster: ClusterConfig):
    """The board actor, created by whoever asks first (launcher or replica)."""
    return ray.remote(ClusterBoard).options(
        name=BOARD_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0).remote(stale_after_s=3 * cluster.stats_period_s + 1.0,
                           forget_after_s=FORGET_AFTER_S)


@serve.ingress()
class MetronomeReplica:
    def __init__(self, config: ServerConfig, cluster: ClusterConfig) -> None:
        torch.set_num_threads(cluster.torch_threads)
        self.config = config
        self.cluster = cluster
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node_ip = ray.util.get_node_ip_address()
        self.board = board_handle(cluster)
        self.server_app: FastAPI | None = None  # (`app` is the wrapper's)

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.config, registry=LabelledRegistry({"replica": self.replica_id}))

        @app.get(CLUSTER_PATH)
        async def cluster() -> dict:
            return await self.board.view.remote()

        self.server_app = app
        return app

    @property
    def serving(self) -> ServerState | None:
        """The serving state, once the app's lifespan has built it."""
        return None if self.server_app is None else getattr(self.server_app.state, "serving",
                                                            None)

    async def record_routing_stats(self) -> dict:
        state = self.serving
        if state is None:
            return {}  # starting: the router ranks it among the replicas not yet reported
        room = ReplicaRoom(cap=state.controller.effective_cap, active=len(state.sessions),
                           healthy=state.driver.error is None, at_s=time.time())
        self.board.report.remote(self.replica_id, self._report(state))
        return room.to_stats()

    async def check_health(self) -> None:
        state = self.serving
        if state is not None and state.driver.error is not None:
            raise RuntimeError(f"engine step failed: {state.driver.error}")

    def _report(self, state: ServerState) -> dict:
        health = state.health()
        return {
            "node_ip": self.node_ip, "pid": os.getpid(), "status": health["status"],
            "reason": health["reason"],
            "kv_stall": health["stall_detector"]["state"],
            "cap": health["admission"]["effective_cap"], "active_sessions": health["sessions"],
            "kv_pool": health["kv_pool"], "goodput_ratio": health["goodput_ratio"]}
