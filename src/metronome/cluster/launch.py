"""`metronome serve --replicas N|MIN..MAX`: start (or join) Ray, deploy the replicas behind
Ray Serve's proxy on `host:port`, and serve until SIGINT/SIGTERM. With MIN..MAX, Ray Serve
autoscales them with `cluster.autoscaler`'s policy, and the launcher prints each decision.

Without `--ray-address` a local Ray cluster is started in this process (and ends with it);
with one, the replicas are placed across that cluster's nodes and this process is only the
deployer: on exit it deletes the application and leaves Ray running.

`metronome cluster scale N` (`scale`) changes the replica count of the running application
through Serve's external-scaler API (`ServeController.update_deployment_replicas`, what the
dashboard's `POST /api/v1/applications/<app>/deployments/<name>/scale` calls; the
application is deployed with `external_scaler_enabled`): a lightweight update, the other
replicas stay up. Redeploying with `serve.run` instead would replace every replica, since
an imperative deployment gets a new random code version each time. An autoscaled
application takes it too, but its autoscaler sets the count again at its next decision.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from metronome.cluster.autoscaler import POLICY_PATH
from metronome.cluster.board import NAMESPACE
from metronome.cluster.config import ClusterConfig
from metronome.cluster.replica import MetronomeReplica, board_handle, logging_level
from metronome.cluster.router import APP_ROUTE_PREFIX, ROUTER_PATH
from metronome.cluster.session_store import STORE_NAME
from metronome.serve.config import ServerConfig

APP_NAME = "metronome"
DEPLOYMENT_NAME = "metronome-server"
DRAIN_KILL_MARGIN_S = 10.0  # Ray's force-kill comes this long after a replica's own drain
# timeout: it sees it is stopping within a drain check, and its closes take ≤ 2 s
LOOK_BACK_MARGIN_PERIODS = 3  # stats older than the refusal window kept for its baseline


def autoscaling_config(cluster: ClusterConfig) -> AutoscalingConfig:
    """Ray Serve's autoscaling for MIN..MAX: our policy on the replicas' stats, Ray's own
    delays and factors off (the policy's cool-down and sustained-spare period decide)."""
    period_s = cluster.autoscale_metrics_period_s
    with warnings.catch_warnings():  # metrics_interval_s: deprecated for env variables, but
        warnings.simplefilter("ignore", DeprecationWarning)  # still what the replica reads
        return AutoscalingConfig(
            min_replicas=cluster.replicas, max_replicas=cluster.max_replicas,
            initial_replicas=cluster.replicas, metrics_interval_s=period_s,
            look_back_period_s=(cluster.autoscale_refusal_window_s
                                + LOOK_BACK_MARGIN_PERIODS * period_s),
            upscale_delay_s=0.0, downscale_delay_s=0.0,
            policy=AutoscalingPolicy(policy_function=POLICY_PATH, policy_kwargs={
                "headroom_sessions": cluster.autoscale_headroom_sessions,
                "refusal_window_s": cluster.autoscale_refusal_window_s,
                "cooldown_s": cluster.autoscale_cooldown_s,
                "down_after_s": cluster.autoscale_down_after_s,
                "metrics_period_s": period_s}))


def application(config: ServerConfig, cluster: ClusterConfig, log_level: str = "info"):
    """The Ray Serve application: `cluster.replicas` replicas of the server (or MIN..MAX,
    autoscaled), placed by admission headroom."""
    count = ({"autoscaling_config": autoscaling_config(cluster)} if cluster.autoscaled
             else {"num_replicas": cluster.replicas})
    deployment = serve.deployment(
        MetronomeReplica, name=DEPLOYMENT_NAME, **count,
        ray_actor_options=cluster.actor_options(),
        # Sessions are long requests: Ray's per-replica request cap must never bind before
        # admission does (the transport's connection cap is the plain server's bound too).
        max_ongoing_requests=config.max_connections,
        # A removed replica drains itself (`cluster.replica`); Ray's graceful shutdown
        # waits for its sessions, checking every stats period, and kills it only past that.
        graceful_shutdown_timeout_s=cluster.drain_timeout_s + DRAIN_KILL_MARGIN_S,
        graceful_shutdown_wait_loop_s=cluster.stats_period_s,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_PATH,
            request_routing_stats_period_s=cluster.stats_period_s,
            request_routing_stats_timeout_s=max(1.0, 2 * cluster.stats_period_s)),
    )
    return deployment.bind(config, cluster, log_level)


def init_ray(address: str | None, log_level: str) -> None:
    """Start a local Ray (address None) or join one. Ray 2.60 starts clusters with token
    auth on (its token in ~/.ray/auth_token) but, joining by an explicit address, turns
    token mode on only if RAY_AUTH_MODE says so (`ray/_private/worker.py`, `init`: only
    for address None or "auto"): do what it does for "auto", so a token there is used."""
    if address is not None:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    ray.init(address=address, namespace=NAMESPACE,
             logging_level=logging_level(log_level),
             **({"include_dashboard": False} if address is None else {}))  # ours: none


def serve_cluster(config: ServerConfig, cluster: ClusterConfig, log_level: str = "info") -> None:
    local = cluster.ray_address is None
    init_ray(cluster.ray_address, log_level)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    board = board_handle(cluster)
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(application(config, cluster, log_level), name=APP_NAME,
                  route_prefix=APP_ROUTE_PREFIX, external_scaler_enabled=True)
        base = f"{config.host}:{config.port}"
        ray_address = ray.get_runtime_context().gcs_address
        replicas = (f"{cluster.replicas}..{cluster.max_replicas} (autoscaled)"
                    if cluster.autoscaled else str(cluster.replicas))
        print(f"metronome: {replicas} replicas of {config.model} behind Ray Serve on "
              f"ws://{base}/v1/realtime  (cluster view: http://{base}/v1/cluster)\n"
              f"           Ray at {ray_address} (metronome cluster scale N --ray-address "
              f"{ray_address}); Ctrl-C stops the application", flush=True)
        seen = 0  # the autoscaler's decisions printed
        while not stop.wait(0.5):  # a timed wait: signal handlers run in between
            if cluster.autoscaled:
                seen = print_decisions(board, seen)
    finally:
        serve.delete(APP_NAME)
        ray.kill(board)
        with contextlib.suppress(ValueError):  # no replica ever made it
            ray.kill(ray.get_actor(STORE_NAME, namespace=NAMESPACE))
        if local:
            serve.shutdown()
        ray.shutdown()


def print_decisions(board, seen: int) -> int:
    """Print the autoscaler's decisions after the `seen`-th; the last one printed."""
    try:
        events = ray.get(board.events_after.remote(seen), timeout=5)
    except ray.exceptions.RayError:
        return seen
    for e in events:
        print(f"metronome: autoscaler {e['direction']}: {e['from']} -> {e['to']} replicas "
              f"({e['reason']}; headroom {e['headroom']}, refused {e['refused']})", flush=True)
    return events[-1]["seq"] if events else seen


def scale(replicas: int, ray_address: str) -> None:
    """Set the running application's replica count; removed replicas drain."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    init_ray(ray_address, "warning")
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        ray.get(controller.update_deployment_replicas.remote(
            DeploymentID(name=DEPLOYMENT_NAME, app_name=APP_NAME), replicas))
    finally:
        ray.shutdown()
