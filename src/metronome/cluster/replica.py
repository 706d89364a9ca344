"""One cluster replica: the whole Realtime server (`serve.app.create_app`) as a Ray Serve
ingress deployment, with its own engine, beat, admission controller and metrics.

Ray Serve builds the app in the replica (`__serve_build_asgi_app__`) and runs its lifespan
there, so the engine and its threads live in the replica's process. Beside the plain
server's routes the replica serves `GET /v1/cluster` (every replica, from the board), labels
every metric with `replica` (and adds the cluster's, `cluster.metrics`), reports its
admission headroom to the router each stats period (`record_routing_stats`) and to the
autoscaler (`record_autoscaling_stats`, read only with `--replicas MIN..MAX`), and fails
Ray's health check once its engine has failed, so Ray replaces it.

A watcher task on the app's loop reports to the board each stats period, and drains: Ray
Serve (2.60) tells a replica it is being removed only by calling its graceful shutdown,
which waits for the replica's ongoing requests (a WebSocket is one for its whole session)
and never tells the user's code (`_private/replica.py`, `_perform_graceful_shutdown`). So
the watcher asks Serve's controller for this replica's state (`get_serve_instance_details`,
what `serve status` shows) and, once it is STOPPING, drains the server: no new session,
the open ones closed 1001 at the drain timeout, before Ray's force-kill
(`graceful_shutdown_timeout_s`, set longer by `DRAIN_KILL_MARGIN_S` in `launch`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager

import ray
import torch
from fastapi import FastAPI
from ray import serve
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

from metronome.cluster.autoscaler import STAT_ACTIVE, STAT_CAP, STAT_REFUSED, STAT_STARTED
from metronome.cluster.board import BOARD_NAME, NAMESPACE, ClusterBoard
from metronome.cluster.config import ClusterConfig
from metronome.cluster.headroom import ReplicaRoom
from metronome.cluster.metrics import ClusterMetrics, ReplicaRegistry
from metronome.cluster.session_store import RayCheckpointStore, store_handle
from metronome.runtime.cores import reserve_for_engine_thread
from metronome.serve.app import create_app
from metronome.serve.config import ServerConfig
from metronome.serve.serving import Serving

CLUSTER_PATH = "/v1/cluster"
FORGET_AFTER_S = 60.0  # a replica gone this long leaves /v1/cluster
DRAIN_CHECK_PERIOD_S = 1.0  # how often a replica asks the controller whether it is stopping
STORE_EXPIRY_MARGIN_S = 30.0  # a checkpoint outlives the resume grace by this much

log = logging.getLogger("ray.serve")


def board_handle(cluster: ClusterConfig):
    """The board actor, created by whoever asks first (launcher or replica)."""
    return ray.remote(ClusterBoard).options(
        name=BOARD_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0).remote(stale_after_s=3 * cluster.stats_period_s + 1.0,
                           forget_after_s=FORGET_AFTER_S)


def logging_level(log_level: str) -> int:
    """`--log-level` (uvicorn's names) as a `logging` level: uvicorn's `trace` is DEBUG."""
    return logging.getLevelNamesMapping().get(log_level.upper(), logging.DEBUG)


def _log_to_stderr(log_level: str) -> None:
    """Metronome's own log lines (take-overs, resumes, failures) at `log_level` in the
    replica's log: Ray sets up its own loggers in a worker, not the root one."""
    logger = logging.getLogger("metronome")
    logger.setLevel(logging_level(log_level))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "%(levelname)s %(asctime)s %(name)s -- %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


@serve.ingress()
class MetronomeReplica:
    def __init__(self, config: ServerConfig, cluster: ClusterConfig,
                 log_level: str = "info") -> None:
        _log_to_stderr(log_level)
        if config.engine == "native":  # the engine thread's, the rest single-threaded
            reserve_for_engine_thread(cluster.torch_threads)
        else:
            torch.set_num_threads(cluster.torch_threads)
        self.config = config
        self.cluster = cluster
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.app_name, self.deployment_name = context.app_name, context.deployment
        self.node_ip = ray.util.get_node_ip_address()
        self.board = board_handle(cluster)
        self.server_app: FastAPI | None = None  # (`app` is the wrapper's)
        self._controller = None  # Serve's controller, looked up on the first drain check
        self.cluster_metrics = ClusterMetrics()
        self.started_at_s = time.time()

    def __serve_build_asgi_app__(self) -> FastAPI:
        registry = ReplicaRegistry({"replica": self.replica_id}, self.cluster_metrics)
        # checkpoints older than a lease are no use: the session would have ended
        store = RayCheckpointStore(store_handle(
            self.config.resume_grace_s + STORE_EXPIRY_MARGIN_S, self.cluster.session_store_bytes))
        app = create_app(self.config, registry=registry, checkpoint_store=store,
                         server_name=self.replica_id)

        @app.get(CLUSTER_PATH)
        async def cluster() -> dict:
            return await self.board.view.remote()

        serving_lifespan = app.router.lifespan_context

        @asynccontextmanager
        async def lifespan(app_: FastAPI):
            async with serving_lifespan(app_) as value:
                watcher = asyncio.create_task(self._watch())
                try:
                    yield value
                finally:
                    watcher.cancel()

        app.router.lifespan_context = lifespan
        self.server_app = app
        return app

    @property
    def serving(self) -> Serving | None:
        """The serving state, once the app's lifespan has built it."""
        return None if self.server_app is None else getattr(self.server_app.state, "serving",
                                                            None)

    async def record_routing_stats(self) -> dict:
        state = self.serving
        if state is None:
            return {}  # starting: the router ranks it among the replicas not yet reported
        room = ReplicaRoom(cap=state.controller.effective_cap, active=len(state.sessions),
                           healthy=state.driver.error is None and not state.draining,
                           at_s=time.time())
        return room.to_stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The autoscaler's signal (`cluster.autoscaler`): Ray Serve calls this each metrics
        period and pushes the values, with their times, to its controller."""
        state = self.serving
        if state is None:
            return {}  # starting: the autoscaler holds until it reports
        controller = state.controller
        refused = sum(n for key, n in controller.counts.items() if key.startswith("refused"))
        healthy = state.driver.error is None and not state.draining
        return {STAT_CAP: controller.effective_cap if healthy else 0,
                STAT_ACTIVE: len(state.sessions), STAT_REFUSED: refused,
                STAT_STARTED: self.started_at_s}

    async def check_health(self) -> None:
        state = self.serving
        if state is not None and state.driver.error is not None:
            raise RuntimeError(f"engine step failed: {state.driver.error}")

    async def _watch(self) -> None:
        """Report to the board each stats period; drain once Serve is stopping this one."""
        checked_at_s = 0.0
        while True:
            state = self.serving
            if state is not None:
                await self._report_to_board(state)
                if not state.draining and time.monotonic() - checked_at_s >= (
                        DRAIN_CHECK_PERIOD_S):
                    checked_at_s = time.monotonic()
                    if await self._stopping():
                        state.drain(self.cluster.drain_timeout_s)
            await asyncio.sleep(self.cluster.stats_period_s)

    async def _report_to_board(self, state: Serving) -> None:
        """Report; keep the board's autoscaling answer for this replica's /metrics."""
        try:
            self.cluster_metrics.autoscaling = await self.board.report.remote(
                self.replica_id, self._report(state))
        except ray.exceptions.RayError:  # the board gone (the application ending)
            log.warning("metronome: could not report to the cluster board", exc_info=True)

    async def _stopping(self) -> bool:
        """Is Serve's controller stopping this replica (scale-down, redeploy, deletion)?"""
        try:
            if self._controller is None:
                self._controller = ray.get_actor(SERVE_CONTROLLER_NAME,
                                                 namespace=SERVE_NAMESPACE)
            details = await self._controller.get_serve_instance_details.remote()
        except Exception:  # the controller restarting: ask again
            log.warning("metronome: could not read this replica's state", exc_info=True)
            return False
        deployment = details.get("applications", {}).get(self.app_name, {}).get(
            "deployments", {}).get(self.deployment_name)
        if deployment is None:  # the application is being deleted
            return True
        return any(r["replica_id"] == self.replica_id and r["state"] == "STOPPING"
                   for r in deployment["replicas"])

    def _report(self, state: Serving) -> dict:
        health = state.health()
        return {
            "node_ip": self.node_ip, "pid": os.getpid(), "status": health["status"],
            "draining": health["draining"],
            "reason": health["reason"],
            "kv_stall": health["stall_detector"]["state"],
            "cap": health["admission"]["effective_cap"], "active_sessions": health["sessions"],
            "kv_pool": health["kv_pool"], "goodput_ratio": health["goodput_ratio"]}
