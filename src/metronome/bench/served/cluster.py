"""`bench cluster`'s measurements on running servers (`server.ServerProcess`): the proxy hop
(the same load on the plain server and a 1-replica cluster, alternately), the capacity ladder
(offered sessions up to the first step that misses or is refused, then bisection) and Ray's
footprint (the launcher's process tree: RSS, idle CPU).

Each takes the knobs it uses as plain arguments; `metronome.bench.cluster_bench` holds the
config, the run and the report."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable

import httpx
import psutil

from metronome.bench.served.server import ServerProcess
from metronome.load.run import LoadConfig, run_load

Log = Callable[[str], None]


def cluster_ready(replicas: int) -> Callable[[str], bool]:
    """A cluster's readiness: every replica reporting in `GET /v1/cluster`."""
    def ready(url: str) -> bool:
        try:
            return httpx.get(url + "/v1/cluster", timeout=2).json()["replicas_live"] == replicas
        except (httpx.HTTPError, ValueError, KeyError):
            return False
    return ready


def active_sessions(server: ServerProcess) -> int:
    if "--replicas" not in server.args:
        return httpx.get(server.url + "/healthz", timeout=5).json()["sessions"]
    return httpx.get(server.url + "/v1/cluster", timeout=5).json()["active_sessions"]


def wait_idle(server: ServerProcess, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while active_sessions(server) and time.monotonic() < deadline:
        time.sleep(0.5)


def load(server: ServerProcess, sessions: int, duration_s: float, ramp_s: float) -> dict:
    """`metronome load`'s summary of one run against `server`, once the server is idle again."""
    with tempfile.TemporaryDirectory() as out:
        config = LoadConfig(url=server.ws_url, sessions=sessions, ramp_s=ramp_s,
                            duration_s=duration_s, out=out)
        summary = asyncio.run(run_load(config))
    wait_idle(server)
    return summary


# ---- the proxy hop ------------------------------------------------------------------------
def proxy_hop(servers: dict[str, ServerProcess], repeats: int, sessions: int,
              duration_s: float, ramp_s: float, log: Log) -> dict:
    """`servers` ("plain", "ray_serve") loaded alternately `repeats` times each: per-run
    client p50/p95, their min and median, and what the second adds to the first."""
    runs: dict[str, list[dict]] = {name: [] for name in servers}
    for k in range(repeats):
        for name, server in servers.items():
            log(f"proxy hop {k + 1}/{repeats}: {name}, {sessions} sessions x {duration_s:g} s")
            latency = load(server, sessions, duration_s, ramp_s)["latency_ms"]["client"]
            runs[name].append({"p50_ms": latency["p50"], "p95_ms": latency["p95"]})
    summary = {name: {f"{q}_{agg}": _agg(agg, [r[f"{q}_ms"] for r in rs])
                      for q in ("p50", "p95") for agg in ("min", "median")}
               for name, rs in runs.items()}
    summary["added"] = {key: summary["ray_serve"][key] - summary["plain"][key]
                        for key in summary["plain"]}
    return {"runs": runs, "summary": summary, "sessions": sessions, "duration_s": duration_s,
            "ramp_s": ramp_s, "repeats": repeats}


def _agg(kind: str, values: list[float]) -> float:
    return min(values) if kind == "min" else statistics.median(values)


# ---- capacity -------------------------------------------------------------------------------
def capacity(ladder: tuple[int, ...], bisect_steps: int, step: Callable[[int], dict]) -> dict:
    """Up the ladder to the first step that does not hold (or was refused), then bisect
    between it and the last that held, `bisect_steps` times at most. `step(offered)` runs
    one step and returns its row (`capacity_step`)."""
    steps = []
    for offered in ladder:
        steps.append(step(offered))
        if not steps[-1]["holds"] or steps[-1]["refused"]:
            break
    held_at = [s["offered"] for s in steps if s["holds"]]
    low, high = (held_at[-1] if held_at else 0), steps[-1]["offered"]
    for _ in range(bisect_steps if not steps[-1]["holds"] else 0):
        if high - low <= 1:
            break
        steps.append(step((low + high) // 2))
        low, high = ((steps[-1]["offered"], high) if steps[-1]["holds"]
                     else (low, steps[-1]["offered"]))
    held = max((s["admitted"] for s in steps if s["holds"]), default=0)
    return {"steps": steps, "held_sessions": held}


def capacity_step(summary: dict, offered: int, miss_limit_share: float) -> dict:
    """One step's row from its load summary: it holds when at most `miss_limit_share` of
    the admitted sessions' frames missed their deadline (server-side)."""
    sessions = summary["sessions"]
    admitted = sessions.get("completed", 0) + sessions.get("closed_by_server", 0)
    good = summary["goodput_server"]
    miss = None if good is None else 1.0 - good
    return {"offered": offered, "admitted": admitted,
            "refused": sessions.get("refused", 0), "failed": sessions.get("failed", 0),
            "frames": summary["frames"], "miss_share": miss,
            "client_p95_ms": summary["latency_ms"]["client"]["p95"],
            "holds": miss is not None and miss <= miss_limit_share}


# ---- Ray's footprint ------------------------------------------------------------------------
def footprint(server: ServerProcess, idle_window_s: float) -> dict:
    """RSS and idle CPU of the launcher's process tree (Ray's processes are its children)."""
    root = psutil.Process(server.process.pid)
    processes = [root, *root.children(recursive=True)]
    before = {}
    for proc in processes:
        try:
            before[proc.pid] = sum(proc.cpu_times()[:2])
        except psutil.Error:
            pass
    time.sleep(idle_window_s)
    cpu_s, rss_by_name = 0.0, Counter()
    for proc in processes:
        try:
            cpu_s += sum(proc.cpu_times()[:2]) - before.get(proc.pid, 0.0)
            rss_by_name[_name(proc)] += proc.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return {"start_s": server.start_s, "processes": len(processes),
            "rss_mib": sum(rss_by_name.values()),
            "rss_mib_by_process": dict(rss_by_name.most_common()),
            "idle_window_s": idle_window_s,
            "idle_cpu_share_of_machine": cpu_s / idle_window_s / psutil.cpu_count()}


def _name(proc: psutil.Process) -> str:
    name = proc.name()
    cmdline = " ".join(proc.cmdline())
    for marker in ("ServeReplica", "ServeController", "ProxyActor", "ClusterBoard",
                   "dashboard", "raylet", "gcs_server", "log_monitor", "runtime_env",
                   "monitor.py"):
        if marker in cmdline or marker in name:
            return marker
    return "launcher" if "metronome" in cmdline and "serve" in cmdline else name

