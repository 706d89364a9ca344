"""`metronome bench cluster`: what Ray Serve costs (`metronome serve --replicas N`) and what
it gives, on loopback with the tiny preset model (one torch thread per server).

1. The proxy hop: the plain server and a 1-replica cluster, both up for the whole part (so
   every run sees the same machine), loaded alternately by `metronome load` at the same
   load, `repeats` times each: client-observed frame latency p50/p95 per run; the min and
   median over the runs, side by side.
2. Capacity: a 1-replica, then a 2-replica cluster, AIMD on (its cap starting above the
   ladder, so AIMD, not the start, decides), offered N sessions from a ladder, each step
   after the last one's sessions closed. A step holds when at most `miss_limit_share` of
   its admitted sessions' frames missed their deadline (server-side); capacity is the most
   sessions a holding step had admitted. The ladder stops at the first step that does not
   hold or where admission refused sessions, then bisects between it and the last that held.
3. Ray's footprint, from the 2-replica start: command to both replicas reporting in
   `GET /v1/cluster`, RSS of every process in the launcher's tree (Ray's own included),
   their CPU while idle, SIGTERM to exit.

The measuring helpers are in `bench.served`; the report (and its figure) reads only the
result. Two sections are not measured by this command and say where they come from: what
the cluster tests assert, and the install cost and close-reason finding from when the
cluster was added.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

from metronome.bench.served import cluster as measure
from metronome.bench.served.server import SINGLE_THREAD, ServerProcess, healthy, served_facts
from metronome.cluster.config import ClusterConfig
from metronome.load.run import LoadConfig
from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.results.tables import fmt, md_table
from metronome.serve.config import ServerConfig

NAME = "cluster"
MODEL = "preset:tiny"  # the 2-layer random test Llama: two replicas and Ray fit beside it
STATS_PERIOD_S = 0.5  # the replicas' reports (placement and `GET /v1/cluster`)
LOG_DIR = Path("out/bench-cluster")  # each server's output (Ray's logs: every request's)


@dataclass(frozen=True)
class Config:
    repeats: int = field(default=5, metadata={"help": "proxy-hop runs of each server"})
    hop_sessions: int = field(default=4, metadata={"help": "sessions of each proxy-hop run"})
    hop_duration_s: float = field(default=15.0, metadata={
        "help": "speech each proxy-hop session streams"})
    hop_ramp_s: float = field(default=1.0, metadata={"help": "a proxy-hop run's sessions "
                                                     "start evenly over this long"})
    ladder: tuple[int, ...] = field(default=(8, 12, 16, 20, 24, 28, 32, 40, 48, 56), metadata={
        "help": "sessions offered, step by step, until one misses or is refused"})
    # 32 decode steps a frame: the replica's engine binds (about 20-30 sessions on one
    # thread here) long before the load generator or Ray's proxy would (4 tokens: > 48)
    output_tokens_per_frame: int = field(default=32, metadata={
        "help": "every server's output tokens a frame (the engine must bind first)"})
    bisect_steps: int = field(default=2, metadata={
        "help": "steps between the last that held and the first that did not"})
    step_duration_s: float = field(default=20.0, metadata={
        "help": "speech each session of a capacity step streams"})
    ramp_s: float = field(default=4.0, metadata={"help": "a capacity step's sessions start "
                                                 "evenly over this long"})
    miss_limit_share: float = field(default=0.01, metadata={
        "help": "a capacity step holds at most this share of deadline misses"})
    idle_window_s: float = field(default=5.0, metadata={
        "help": "the footprint's idle CPU is measured over this long"})
    goal_ratio: float = field(default=1.8, metadata={
        "help": "the 2-replica / 1-replica capacity the report compares against"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(repeats=1, hop_sessions=1, hop_duration_s=3.0, ladder=(2,), bisect_steps=0,
                   step_duration_s=3.0, ramp_s=0.5)


def serve_args(cfg: Config, admission_cap: int, replicas: int | None) -> list[str]:
    """`metronome serve` options of the plain server (replicas None) or a cluster."""
    args = ["--model", MODEL, "--admission", "aimd", "--admission-cap", str(admission_cap),
            "--output-tokens-per-frame", str(cfg.output_tokens_per_frame),
            "--log-level", "warning"]
    return args + ([] if replicas is None else [
        "--replicas", str(replicas), "--stats-period-s", f"{STATS_PERIOD_S:g}"])


def start(cfg: Config, admission_cap: int, replicas: int | None) -> ServerProcess:
    ready = healthy if replicas is None else measure.cluster_ready(replicas)
    return ServerProcess.start(serve_args(cfg, admission_cap, replicas), ready,
                               LOG_DIR / f"{replicas or 'plain'}.log")


def run(ctx: RunContext, cfg: Config) -> dict:
    cap = max(cfg.ladder) + 1  # AIMD's start: above every step
    settings = ServerConfig(model=MODEL, admission="aimd", admission_cap=cap,
                            output_tokens_per_frame=cfg.output_tokens_per_frame)
    ctx.record(**served_facts(settings), ray=version("ray"))
    ctx.log("starting the plain server and a 1-replica cluster")
    plain, one = start(cfg, cap, None), start(cfg, cap, 1)
    commands = {"plain": plain.command, "1": one.command}
    try:
        hop = measure.proxy_hop({"plain": plain, "ray_serve": one}, cfg.repeats,
                                cfg.hop_sessions, cfg.hop_duration_s, cfg.hop_ramp_s, ctx.log)
        ctx.keep("proxy_hop", hop)
    finally:
        plain.stop()
    try:
        capacities = [_measure_capacity(ctx, cfg, one, 1)]
    finally:
        one.stop()
    ctx.log("starting a 2-replica cluster")
    two = start(cfg, cap, 2)
    commands["2"] = two.command
    try:
        ray_footprint = measure.footprint(two, cfg.idle_window_s)
        capacities.append(_measure_capacity(ctx, cfg, two, 2))
    finally:
        ray_footprint["exit_s"] = two.stop()
    held = [c["held_sessions"] for c in capacities]
    plot(ctx, hop, capacities)
    load = LoadConfig()
    return {"config": asdict(cfg), "server_commands": commands, "workload": {
                "admission_cap_start": cap, "frame_period_s": settings.frame_period_s,
                "admission_interval_s": settings.admission_interval_s,
                "torch_threads_per_server": int(SINGLE_THREAD["OMP_NUM_THREADS"]),
                "torch_threads_per_replica": ClusterConfig(replicas=1).torch_threads,
                "load_chunk_ms": load.chunk_ms, "load_sample_rate_hz": load.sample_rate_hz},
            "proxy_hop": hop, "capacity": capacities,
            "capacity_ratio": held[1] / held[0] if held[0] else None,
            "footprint": ray_footprint}


def _measure_capacity(ctx: RunContext, cfg: Config, server: ServerProcess, replicas: int) -> dict:
    def step(offered: int) -> dict:
        ctx.log(f"capacity, {replicas} replica(s): {offered} sessions offered")
        row = measure.capacity_step(measure.load(server, offered, cfg.step_duration_s,
                                                 cfg.ramp_s), offered, cfg.miss_limit_share)
        ctx.log(f"  admitted {row['admitted']}, refused {row['refused']}, misses "
                f"{fmt(row['miss_share'], '.1%')}")
        return row

    result = {"replicas": replicas} | measure.capacity(cfg.ladder, cfg.bisect_steps, step)
    ctx.keep(f"capacity_{replicas}", result)
    return result


# ---- the report: every number from the result -----------------------------------------------
TESTED = """\
## Failure and scale-down (not measured by this command)
What `tests/cluster/test_cluster.py` asserts, with that file's constants (a 6 s drain
timeout, sockets closed within 2 s); `make test` runs it:
- kill -9 of a replica: its session's socket drops within 2 s (1006, see below), the other
  replica's session stays open, a new session is admitted on the survivor, and Ray's
  replacement reports in `GET /v1/cluster`;
- scale 2 -> 1 (`metronome cluster scale 1`) with a streaming session on each replica and a
  6 s drain timeout: the removed replica shows `draining`, takes none of the new sessions,
  answers its session's frames until the timeout, then sends `server_draining` and closes
  1001 "server draining: drain timeout"; the other replica's session misses no deadline.
"""

INSTALL = """\
## Install (not measured by this command)
Measured once by hand on 2026-12-01 (commit 529ec16), on a 2-CPU, 23.5 GiB Linux machine:
`pip install 'ray[serve]==2.60.0'` into the project venv took 34 s and grew the venv from
1,560 MB to 1,903 MB (+343 MB). It brings no torch and changes none of the server's pins
(fastapi, starlette, uvicorn, websockets, pydantic).
"""

RAY_READ = "2.60.0"  # the Ray whose source the close-reason finding was read in
CLOSE_REASON = """\
## Close reason on replica death (not measured by this command)
Read in Ray Serve {read}'s source when the cluster was added (2026-12-01, commit 00259e3);
this run used Ray {ran}{differs}. Not feasible with that proxy, so the client sees 1006 (no
close frame, no reason) when a replica dies mid-session; the kill test asserts exactly
that. Why, in Ray's source (`ray/serve/_private/`):
- `proxy.py`, `ProxyActor.proxy_request` (the `except BaseException` branch after the
  `async for asgi_message_batch in response_generator` loop): the replica's death surfaces
  as an exception of the response generator; the proxy then yields only what
  `send_http_response_on_exception` returns;
- `http_util.py`, `send_http_response_on_exception`: `if response_started or status.code
  not in (408, 429, 503): return []`: once the WebSocket was accepted the response has
  started, so nothing is sent, not even a `websocket.close`;
- the proxy's ASGI app then returns, and uvicorn (`uvicorn/protocols/websockets/
  websockets_impl.py`, `run_asgi`) ends with `self.transport.close()`: the TCP connection
  drops without a close frame.
The dead replica cannot send one, and Metronome has no hook in Ray's proxy (a patched
proxy would be a fork of Ray). What a client can rely on: a 1006 from the cluster
endpoint means the replica is gone; reconnecting places the session on a live replica
(the kill test: new sessions succeed on the survivor). The reasons the server itself gives
(1001 drain timeout, 1008, 1011, 1013) pass through the proxy intact.
"""


def report(result: dict) -> str:
    cfg, work, prov = result["config"], result["workload"], result["provenance"]
    ran = prov["ray"]
    lines: list[str] = [
        "# Ray Serve cluster (`metronome serve --replicas N`): cost and capacity", "",
        describe(prov), "",
        f"Command: `{result['command']}` ({result['elapsed_s'] / 60:.1f} min). Servers, "
        "each on loopback (a cluster is a local Ray started by its own command): "
        + "; ".join(f"`{cmd}`" for cmd in result["server_commands"].values()) + f". That is "
        f"{work['torch_threads_per_server']} torch thread(s) a plain server and "
        f"{work['torch_threads_per_replica']} a replica, {cfg['output_tokens_per_frame']} "
        "output tokens a frame (so the engine, not the load generator or Ray's proxy, binds "
        f"first), AIMD admission starting at a cap of {work['admission_cap_start']}, above "
        "the ladder. Load: `metronome load` (real WebSocket clients streaming speech at "
        f"real-time pace in {work['load_chunk_ms']:g} ms appends, {work['frame_period_s']:g} "
        "s frames) from the bench's process.", "",
        *(f"![proxy hop and capacity]({name})" for name in result["plots"]), "",
        *_hop(result["proxy_hop"]), "", *_capacity(result), "",
        *_footprint(result["footprint"]), "", TESTED, INSTALL,
        CLOSE_REASON.format(read=RAY_READ, ran=ran, differs="" if ran == RAY_READ else (
            ": a different version, so the finding may no longer hold")),
    ]
    if result["scale"] == "smoke":
        lines.insert(2, "**Smoke size: too short to mean anything; it checks the command.**\n")
    return "\n".join(lines) + "\n"


def _hop(hop: dict) -> list[str]:
    s = hop["summary"]
    rows = [[f"{q}, {a} of runs", fmt(s["plain"][f"{q}_{a}"], ".1f"),
             fmt(s["ray_serve"][f"{q}_{a}"], ".1f"), fmt(s["added"][f"{q}_{a}"], "+.1f")]
            for q in ("p50", "p95") for a in ("median", "min")]
    per_run = {name: ", ".join(f"{r['p50_ms']:.1f} / {r['p95_ms']:.1f}" for r in runs)
               for name, runs in hop["runs"].items()}
    return [
        "## The proxy hop", f"{hop['sessions']} sessions x {hop['duration_s']:g} s of speech "
        f"(started over {hop['ramp_s']:g} s) against the plain `metronome serve` and a "
        f"1-replica cluster, both running the whole time, alternately, {hop['repeats']} runs "
        "each; client-observed frame latency (frame end to its result at the client), "
        "per-run percentiles, then the median and the min over the runs.", "",
        md_table(["frame latency, ms", "plain server", "through Ray Serve", "added"], rows), "",
        f"Per run (p50 / p95 ms): plain {per_run['plain']}; Ray Serve {per_run['ray_serve']}.",
    ]


def _capacity(result: dict) -> list[str]:
    cfg, work = result["config"], result["workload"]
    limit = fmt(cfg["miss_limit_share"], ".0%")
    rows = [[cap["replicas"], s["offered"], s["admitted"], s["refused"], s["frames"],
             fmt(s["miss_share"], ".1%"), fmt(s["client_p95_ms"], ".0f"),
             "yes" if s["holds"] else "no"]
            for cap in result["capacity"] for s in cap["steps"]]
    lines = [f"## Capacity: {' vs '.join(str(c['replicas']) for c in result['capacity'])} "
             f"replicas", f"Sessions held at <= {limit} deadline misses (server-side, over "
             "the admitted sessions' frames), AIMD on; the ladder of offered sessions "
             f"({', '.join(map(str, cfg['ladder']))}) stops at the first step that does not "
             "hold or where admission refused, then bisects between it and the last step "
             f"that held, {cfg['bisect_steps']} times at most (rows in the order run), each "
             f"session streaming {cfg['step_duration_s']:g} s, a step's sessions starting "
             f"over {cfg['ramp_s']:g} s.", "",
             md_table(["replicas", "offered", "admitted", "refused", "frames", "misses",
                       "client p95 ms", "holds"], rows)]
    if not any(s["refused"] for c in result["capacity"] for s in c["steps"]):
        lines += ["", "AIMD refused no session in any step: a step's sessions all arrive "
                  f"within its {cfg['ramp_s']:g} s ramp, faster than AIMD's control interval "
                  f"({work['admission_interval_s']:g} s) reacts, so the ladder, not AIMD's "
                  "cap, found these numbers."]
    held = [c["held_sessions"] for c in result["capacity"]]
    ratio = result["capacity_ratio"]
    cpus = result["provenance"]["machine"]["logical_cpus"]
    lines += ["", f"Held: {held[0]} sessions with 1 replica, {held[1]} with 2: "
              + (f"{ratio:.2f}x (goal >= {cfg['goal_ratio']:g}x)." if ratio
                 else "no ratio (1 replica held none).")
              + f" The machine's {cpus} logical CPUs also run Ray's proxy (every message of "
              "every session passes through it), Ray's own processes and the load generator: "
              "two replicas double what one holds only where those fit beside them."]
    return lines


def _footprint(fp: dict) -> list[str]:
    by_name = ", ".join(f"{name} {mib:.0f}" for name, mib in fp["rss_mib_by_process"].items())
    return [
        "## Ray's footprint (2 replicas, idle)",
        md_table(["what", "measured"], [
            ["start (command to both replicas in `GET /v1/cluster`)", f"{fp['start_s']:.1f} s"],
            [f"RSS, the launcher's whole process tree ({fp['processes']} processes)",
             f"{fp['rss_mib']:,.0f} MiB: {by_name}"],
            [f"CPU while idle ({fp['idle_window_s']:g} s)",
             f"{fp['idle_cpu_share_of_machine']:.1%} of the machine"],
            ["SIGTERM to exit", f"{fp['exit_s']:.1f} s"]]),
        "", "RSS counts shared pages (Ray's object store, the replicas' torch) once per "
        "process, so it overstates what the tree takes together.",
    ]


def plot(ctx: RunContext, hop: dict, capacities: list[dict]) -> None:
    plt, save = ctx.figure("cluster.png")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    s = hop["summary"]
    for offset, (name, label) in enumerate((("plain", "plain server"),
                                            ("ray_serve", "through Ray Serve"))):
        values = [s[name]["p50_median"], s[name]["p95_median"]]
        ax1.bar([i + 0.38 * offset for i in (0, 1)], values, width=0.36, label=label)
    ax1.set_xticks([0.19, 1.19], ["p50", "p95"])
    ax1.set_ylabel("client frame latency, ms (median of runs)")
    ax1.set_title("the proxy hop")
    ax1.legend(fontsize=8)
    for cap in capacities:
        steps = cap["steps"]
        ax2.plot([st["offered"] for st in steps], [st["admitted"] for st in steps],
                 marker="o", label=f"{cap['replicas']} replica(s), held {cap['held_sessions']}")
    ax2.set_xlabel("sessions offered")
    ax2.set_ylabel("sessions admitted")
    ax2.set_title("capacity (AIMD on)")
    ax2.legend(fontsize=8)
    save(fig)
