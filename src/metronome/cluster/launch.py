"""`metronome serve --replicas N`: start (or join) Ray, deploy the replicas behind Ray
Serve's proxy on `host:port`, and serve until SIGINT/SIGTERM.

Without `--ray-address` a local Ray cluster is started in this process (and ends with it);
with one, the replicas are placed across that cluster's nodes and this process is only the
deployer: on exit it deletes the application and leaves Ray running.
"""

from __future__ import annotations

import logging
import signal
import threading

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from metronome.cluster.config import ClusterConfig
from metronome.cluster.replica import NAMESPACE, MetronomeReplica, board_handle
from metronome.cluster.router import APP_ROUTE_PREFIX, ROUTER_PATH
from metronome.serve.config import ServerConfig

APP_NAME = "metronome"


def application(config: ServerConfig, cluster: ClusterConfig):
    """The Ray Serve application: `cluster.replicas` replicas of the server, placed by
    admission headroom."""
    deployment = serve.deployment(
        MetronomeReplica, name="metronome-server", num_replicas=cluster.replicas,
        ray_actor_options=cluster.actor_options(),
        # Sessions are long requests: Ray's per-replica request cap must never bind before
        # admission does (the transport's connection cap is the plain server's bound too).
        max_ongoing_requests=config.max_connections,
        graceful_shutdown_timeout_s=cluster.drain_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_PATH,
            request_routing_stats_period_s=cluster.stats_period_s,
            request_routing_stats_timeout_s=max(1.0, 2 * cluster.stats_period_s)),
    )
    return deployment.bind(config, cluster)


def serve_cluster(config: ServerConfig, cluster: ClusterConfig, log_level: str = "info") -> None:
    local = cluster.ray_address is None
    ray.init(address=cluster.ray_address, namespace=NAMESPACE,
             logging_level=logging.getLevelName(log_level.upper()),
             **({"include_dashboard": False} if local else {}))  # ours: no dashboard
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    board = board_handle(cluster)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(application(config, cluster), name=APP_NAME, route_prefix=APP_ROUTE_PREFIX)
        base = f"{config.host}:{config.port}"
        print(f"metronome: {cluster.replicas} replicas of {config.model} behind Ray Serve on "
              f"ws://{base}/v1/realtime  (cluster view: http://{base}/v1/cluster)\n"
              "           (Ctrl-C stops the application)", flush=True)
        while not stop.wait(0.5):  # a timed wait: signal handlers run in between
            pass
    finally:
        serve.delete(APP_NAME)
        ray.kill(board)
        if local:
            serve.shutdown()
        ray.shutdown()
