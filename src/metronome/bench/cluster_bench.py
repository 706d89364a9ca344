"""`metronome bench cluster`: what Ray Serve costs (`metronome serve --replicas N`) and what
it gives, on loopback with the tiny preset model (one torch thread per server).

1. The proxy hop: the plain server and a 1-replica cluster, both up for the whole part (so
   every run sees the same machine), loaded alternately by `metronome load` at the same
   load, `repeats` times each: client-observed frame latency p50/p95 per run; the min and
   median over the runs, side by side.
2. Capacity: a 1-replica, then a 2-replica cluster, AIMD on (its cap starting above the
   ladder, so AIMD, not the start, decides), offered N sessions from a ladder, each step
   after the last one's sessions closed. A step holds when at most 1 % of its admitted
   sessions' frames missed their deadline (server-side); capacity is the most sessions
   a holding step had admitted. The ladder stops at the first step that does not hold or
   where admission refused sessions, then bisects between it and the last that held.
3. Ray's footprint, from the 2-replica start: command to both replicas reporting in
   `GET /v1/cluster`, RSS of every process in the launcher's tree (Ray's own included),
   their CPU while idle, SIGTERM to exit.

Writes JSON, a markdown report with the command and the machine, and a PNG.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from metronome.load.run import LoadConfig, run_load

COMMAND = "metronome bench cluster"
STARTUP_TIMEOUT_S = 180.0
IDLE_S = 5.0  # the footprint's idle CPU window
MISS_LIMIT = 0.01  # a capacity step holds at <= 1 % deadline misses
LOG_DIR = Path("out/bench-cluster")
SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # the plain server's torch


@dataclass(frozen=True)
class ClusterBenchConfig:
    smoke: bool = False
    repeats: int = 5  # proxy-hop runs of each server
    hop_sessions: int = 4
    hop_duration_s: float = 15.0
    ladder: tuple[int, ...] = (8, 12, 16, 20, 24, 28, 32, 40, 48, 56)
    # 32 decode steps a frame: the replica's engine binds (about 20-30 sessions on one
    # thread here) long before the load generator or Ray's proxy would (4 tokens: > 48)
    output_tokens_per_frame: int = 32
    bisect_steps: int = 2  # between the last step that held and the first that did not
    step_duration_s: float = 20.0
    ramp_s: float = 4.0
    out_md: str = "docs/results/cluster.md"
    out_json: str = "docs/results/cluster.json"

    @classmethod
    def smoke_size(cls, **paths) -> ClusterBenchConfig:
        return cls(smoke=True, repeats=1, hop_sessions=1, hop_duration_s=3.0, ladder=(2,),
                   bisect_steps=0, step_duration_s=3.0, ramp_s=0.5, **paths)


# ---- servers ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve_args(port: int, replicas: int | None, admission_cap: int,
                output_tokens: int) -> list[str]:
    args = [str(Path(sys.executable).parent / "metronome"), "serve", "--model", "preset:tiny",
            "--port", str(port), "--admission", "aimd", "--admission-cap", str(admission_cap),
            "--output-tokens-per-frame", str(output_tokens), "--log-level", "warning"]
    return args + (["--replicas", str(replicas), "--stats-period-s", "0.5"] if replicas
                   else [])


def _ready(url: str, replicas: int | None) -> bool:
    try:
        if replicas is None:
            return httpx.get(url + "/healthz", timeout=2).status_code == 200
        return httpx.get(url + "/v1/cluster", timeout=2).json()["replicas_live"] == replicas
    except (httpx.HTTPError, ValueError, KeyError):
        return False


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    replicas: int | None  # None: the plain server
    start_s: float  # command to ready

    @classmethod
    def start(cls, replicas: int | None, admission_cap: int, output_tokens: int) -> Server:
        """Its output (Ray's logs: every request's) goes to LOG_DIR/<replicas>.log."""
        port = _free_port()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log_path = LOG_DIR / f"{replicas or 'plain'}.log"
        started = time.monotonic()
        with log_path.open("w") as log:
            process = subprocess.Popen(_serve_args(port, replicas, admission_cap,
                                                   output_tokens),
                                       env=os.environ | SINGLE_THREAD, stdout=log, stderr=log)
        url = f"http://127.0.0.1:{port}"
        while not _ready(url, replicas):
            if process.poll() is not None or time.monotonic() - started > STARTUP_TIMEOUT_S:
                process.kill()
                raise RuntimeError(f"the server did not come up: see {log_path}")
            time.sleep(0.25)
        return cls(process, url, replicas, time.monotonic() - started)

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws") + "/v1/realtime"

    def active_sessions(self) -> int:
        if self.replicas is None:
            return httpx.get(self.url + "/healthz", timeout=5).json()["sessions"]
        return httpx.get(self.url + "/v1/cluster", timeout=5).json()["active_sessions"]

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.active_sessions() and time.monotonic() < deadline:
            time.sleep(0.5)

    def stop(self) -> float:
        """SIGTERM; seconds to exit."""
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return time.monotonic() - started


# ---- measurements ---------------------------------------------------------------------------
def _load(server: Server, sessions: int, duration_s: float, ramp_s: float) -> dict:
    with tempfile.TemporaryDirectory() as out:
        config = LoadConfig(url=server.ws_url, sessions=sessions, ramp_s=ramp_s,
                            duration_s=duration_s, out=out)
        summary = asyncio.run(run_load(config))
    server.wait_idle()
    return summary


def proxy_hop(config: ClusterBenchConfig, plain: Server, ray: Server) -> dict:
    runs: dict[str, list[dict]] = {"plain": [], "ray_serve": []}
    for k in range(config.repeats):
        for name, server in (("plain", plain), ("ray_serve", ray)):
            _progress(f"proxy hop {k + 1}/{config.repeats}: {name}, {config.hop_sessions} "
                      f"sessions x {config.hop_duration_s:g} s")
            latency = _load(server, config.hop_sessions, config.hop_duration_s,
                            1.0)["latency_ms"]["client"]
            runs[name].append({"p50_ms": latency["p50"], "p95_ms": latency["p95"]})
    summary = {name: {f"{q}_{agg}": _agg(agg, [r[f"{q}_ms"] for r in rs])
                      for q in ("p50", "p95") for agg in ("min", "median")}
               for name, rs in runs.items()}
    summary["added"] = {key: summary["ray_serve"][key] - summary["plain"][key]
                        for key in summary["plain"]}
    return {"runs": runs, "summary": summary, "sessions": config.hop_sessions,
            "duration_s": config.hop_duration_s}


def _agg(kind: str, values: list[float]) -> float:
    return min(values) if kind == "min" else statistics.median(values)


def capacity(config: ClusterBenchConfig, server: Server) -> dict:
    """Up the ladder to the first step that does not hold (or was refused), then bisect
    between it and the last that held, `bisect_steps` times at most."""
    steps = []
    for offered in config.ladder:
        steps.append(_step(config, server, offered))
        if not steps[-1]["holds"] or steps[-1]["refused"]:
            break
    held_at = [s["offered"] for s in steps if s["holds"]]
    low, high = (held_at[-1] if held_at else 0), steps[-1]["offered"]
    for _ in range(config.bisect_steps if not steps[-1]["holds"] else 0):
        if high - low <= 1:
            break
        steps.append(_step(config, server, (low + high) // 2))
        low, high = ((steps[-1]["offered"], high) if steps[-1]["holds"]
                     else (low, steps[-1]["offered"]))
    held = max((s["admitted"] for s in steps if s["holds"]), default=0)
    return {"replicas": server.replicas, "steps": steps, "held_sessions": held}


def _step(config: ClusterBenchConfig, server: Server, offered: int) -> dict:
    _progress(f"capacity, {server.replicas} replica(s): {offered} sessions offered")
    summary = _load(server, offered, config.step_duration_s, config.ramp_s)
    sessions = summary["sessions"]
    admitted = sessions.get("completed", 0) + sessions.get("closed_by_server", 0)
    good = summary["goodput_server"]
    miss = None if good is None else 1.0 - good
    step = {"offered": offered, "admitted": admitted,
            "refused": sessions.get("refused", 0), "failed": sessions.get("failed", 0),
            "frames": summary["frames"], "miss_share": miss,
            "client_p95_ms": summary["latency_ms"]["client"]["p95"],
            "holds": miss is not None and miss <= MISS_LIMIT}
    _progress(f"  admitted {admitted}, refused {step['refused']}, misses "
              f"{'-' if miss is None else f'{miss:.1%}'}")
    return step


def _tree(process: subprocess.Popen) -> list[psutil.Process]:
    root = psutil.Process(process.pid)
    return [root, *root.children(recursive=True)]


def footprint(server: Server) -> dict:
    """RSS and idle CPU of the launcher's process tree (Ray's processes are its children)."""
    processes = _tree(server.process)
    before = {}
    for proc in processes:
        try:
            before[proc.pid] = sum(proc.cpu_times()[:2])
        except psutil.Error:
            pass
    time.sleep(IDLE_S)
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
            "idle_cpu_share_of_machine": cpu_s / IDLE_S / psutil.cpu_count()}


def _name(proc: psutil.Process) -> str:
    name = proc.name()
    cmdline = " ".join(proc.cmdline())
    for marker in ("ServeReplica", "ServeController", "ProxyActor", "ClusterBoard",
                   "dashboard", "raylet", "gcs_server", "log_monitor", "runtime_env",
                   "monitor.py"):
        if marker in cmdline or marker in name:
            return marker
    return "launcher" if "metronome" in cmdline and "serve" in cmdline else name


# ---- the run --------------------------------------------------------------------------------
def run(config: ClusterBenchConfig) -> dict:
    started = time.time()
    cap = max(config.ladder) + 1  # AIMD's start: above every step
    _progress("starting the plain server and a 1-replica cluster")
    tokens = config.output_tokens_per_frame
    plain, one = Server.start(None, cap, tokens), Server.start(1, cap, tokens)
    try:
        hop = proxy_hop(config, plain, one)
    finally:
        plain.stop()
    try:
        capacities = [capacity(config, one)]
    finally:
        one.stop()
    _progress("starting a 2-replica cluster")
    two = Server.start(2, cap, tokens)
    try:
        ray_footprint = footprint(two)
        capacities.append(capacity(config, two))
    finally:
        ray_footprint["exit_s"] = two.stop()
    held = [c["held_sessions"] for c in capacities]
    result = {"command": COMMAND + (" --smoke" if config.smoke else ""),
              "config": asdict(config), "machine": _machine(),
              "elapsed_s": time.time() - started, "proxy_hop": hop,
              "capacity": capacities,
              "capacity_ratio": held[1] / held[0] if held[0] else None,
              "footprint": ray_footprint}
    _write(config, result)
    return result


def _progress(text: str) -> None:
    print(f"[bench cluster] {text}", file=sys.stderr, flush=True)


def _machine() -> dict:
    import ray
    import torch

    return {"cpus": psutil.cpu_count(), "memory_gib": psutil.virtual_memory().total / 2**30,
            "python": platform.python_version(), "torch": torch.__version__,
            "ray": ray.__version__, "platform": platform.platform()}


def _write(config: ClusterBenchConfig, result: dict) -> None:
    from metronome.bench.cluster_report import plot, report

    out_md, out_json = Path(config.out_md), Path(config.out_json)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2))
    plot(result, out_md.with_suffix(".png"))
    out_md.write_text(report(result, out_md.with_suffix(".png").name))
