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
4. Autoscaling: a `--replicas MIN..MAX` cluster (static admission, so the autoscaler, not
   AIMD, is what moves), offered sessions stepping up and down, refused ones retrying;
   replicas, headroom, refusals and misses over time, and each decision's effect time.

`--runs fixed` (1-3) or `--runs autoscaling` (4) runs one half.

The measuring helpers are in `bench.served`; the report (and its figure) reads only the
result. Two sections are not measured by this command and say where they come from: what
the cluster tests assert, and the install cost and close-reason finding from when the
cluster was added.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

from metronome.bench.served import autoscale as autoscaling
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
RUNS = ("fixed", "autoscaling")  # see the module docstring: 1-3, 4
SAMPLE_PERIOD_S = 1.0  # the autoscaling run's look at /v1/cluster
FIXED_PLOT, AUTOSCALING_PLOT = "cluster.png", "cluster_autoscaling.png"
BIN_S = 5.0  # the autoscaling run's refusals and misses are counted per this long


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
    runs: tuple[str, ...] = field(default=RUNS, metadata={
        "help": "fixed (the proxy hop, capacity, footprint) and/or autoscaling"})
    autoscale_replicas: str = field(default="1..3", metadata={
        "help": "the autoscaling run's --replicas MIN..MAX"})
    autoscale_cap: int = field(default=4, metadata={
        "help": "the autoscaling run's sessions per replica (static admission)"})
    autoscale_levels: tuple[int, ...] = field(default=(2, 6, 10, 6, 2), metadata={
        "help": "sessions offered, one level a step"})
    autoscale_step_s: float = field(default=40.0, metadata={"help": "each level's length"})
    autoscale_cooldown_s: float = field(default=5.0, metadata={
        "help": "the autoscaler's cool-down (--autoscale-cooldown-s)"})
    autoscale_down_after_s: float = field(default=15.0, metadata={
        "help": "the autoscaler's sustained-spare period (--autoscale-down-after-s)"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(repeats=1, hop_sessions=1, hop_duration_s=3.0, ladder=(2,), bisect_steps=0,
                   step_duration_s=3.0, ramp_s=0.5, autoscale_replicas="1..2",
                   autoscale_cap=1, autoscale_levels=(1, 2, 0), autoscale_step_s=15.0,
                   autoscale_cooldown_s=2.0, autoscale_down_after_s=4.0)


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
    unknown = set(cfg.runs) - set(RUNS)
    if unknown or not cfg.runs:
        raise ValueError(f"--runs takes {' and/or '.join(RUNS)}, got {list(cfg.runs)}")
    ctx.record(**served_facts(ServerConfig(model=MODEL)), ray=version("ray"))
    result = {"config": asdict(cfg)}
    if "fixed" in cfg.runs:
        result |= _fixed(ctx, cfg)
    if "autoscaling" in cfg.runs:
        result["autoscaling"] = _autoscaling(ctx, cfg)
    return result


def _autoscaling(ctx: RunContext, cfg: Config) -> dict:
    args = ["--model", MODEL, "--admission", "static", "--admission-cap",
            str(cfg.autoscale_cap), "--replicas", cfg.autoscale_replicas, "--replica-cpus",
            "0.5", "--stats-period-s", f"{STATS_PERIOD_S:g}", "--autoscale-cooldown-s",
            f"{cfg.autoscale_cooldown_s:g}", "--autoscale-down-after-s",
            f"{cfg.autoscale_down_after_s:g}", "--log-level", "warning"]
    ctx.log(f"autoscaling: starting a {cfg.autoscale_replicas} cluster")
    server = ServerProcess.start(args, measure.cluster_ready(1), LOG_DIR / "autoscaling.log")
    try:
        ctx.log(f"autoscaling: offering {', '.join(map(str, cfg.autoscale_levels))} sessions, "
                f"{cfg.autoscale_step_s:g} s each")
        raw = autoscaling.run(server.url, cfg.autoscale_levels, cfg.autoscale_step_s,
                              SAMPLE_PERIOD_S)
    finally:
        server.stop()
    ctx.keep("autoscaling_raw", raw)
    result = {"command": server.command, "defaults": ClusterConfig(replicas=1).model_dump(
                  include={"autoscale_headroom_sessions", "autoscale_refusal_window_s"}),
              "samples": raw["samples"], "sessions": raw["sessions"],
              "timeline": autoscaling.timeline(raw, cfg.autoscale_levels, cfg.autoscale_step_s),
              "binned": autoscaling.binned(raw, BIN_S), "summary": autoscaling.summary(raw)}
    plot_autoscaling(ctx, result, cfg.autoscale_step_s, cfg.autoscale_levels)
    return result


def _fixed(ctx: RunContext, cfg: Config) -> dict:
    cap = max(cfg.ladder) + 1  # AIMD's start: above every step
    settings = ServerConfig(model=MODEL, admission="aimd", admission_cap=cap,
                            output_tokens_per_frame=cfg.output_tokens_per_frame)
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
    return {"server_commands": commands, "workload": {
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
    lines: list[str] = [
        "# Ray Serve cluster (`metronome serve --replicas N|MIN..MAX`)", "",
        describe(result["provenance"]), "",
        f"Command: `{result['command']}` ({result['elapsed_s'] / 60:.1f} min).", ""]
    if "proxy_hop" in result:
        lines += _fixed_report(result)
    if "autoscaling" in result:
        lines += _autoscaling_report(result["autoscaling"], result["config"])
    if result["scale"] == "smoke":
        lines.insert(2, "**Smoke size: too short to mean anything; it checks the command.**\n")
    return "\n".join(lines) + "\n"


def _fixed_report(result: dict) -> list[str]:
    cfg, work, prov = result["config"], result["workload"], result["provenance"]
    ran = prov["ray"]
    return [
        "Servers, "
        "each on loopback (a cluster is a local Ray started by its own command): "
        + "; ".join(f"`{cmd}`" for cmd in result["server_commands"].values()) + f". That is "
        f"{work['torch_threads_per_server']} torch thread(s) a plain server and "
        f"{work['torch_threads_per_replica']} a replica, {cfg['output_tokens_per_frame']} "
        "output tokens a frame (so the engine, not the load generator or Ray's proxy, binds "
        f"first), AIMD admission starting at a cap of {work['admission_cap_start']}, above "
        "the ladder. Load: `metronome load` (real WebSocket clients streaming speech at "
        f"real-time pace in {work['load_chunk_ms']:g} ms appends, {work['frame_period_s']:g} "
        "s frames) from the bench's process.", "",
        *(f"![proxy hop and capacity]({name})" for name in result["plots"]
          if name == FIXED_PLOT), "",
        *_hop(result["proxy_hop"]), "", *_capacity(result), "",
        *_footprint(result["footprint"]), "", TESTED, INSTALL,
        CLOSE_REASON.format(read=RAY_READ, ran=ran, differs="" if ran == RAY_READ else (
            ": a different version, so the finding may no longer hold")),
    ]


def _autoscaling_report(auto: dict, cfg: dict) -> list[str]:
    total, defaults = auto["summary"], auto["defaults"]
    rows = [[r["step"], f"{r['from_s']:g}", r["offered"],
             f"{r['replicas_min']}..{r['replicas_max']}", r["headroom_min"], r["refusals"],
             r["frames"], r["misses"]] for r in auto["timeline"]]
    decisions = [[f"{d['t_s']:.1f}", f"{d['direction']} {d['from']} -> {d['to']}",
                  d["reason"], d["headroom"], d["refused"], fmt(d["effect_s"], ".1f")]
                 for d in total["decisions"]]
    misses = total["misses"] / total["frames"] if total["frames"] else None
    return [
        f"## Autoscaling (`--replicas {cfg['autoscale_replicas']}`)",
        f"`{auto['command']}`: static admission of {cfg['autoscale_cap']} session(s) a replica "
        "(so the autoscaler, not AIMD, is what moves), the autoscaler's headroom threshold "
        f"{defaults['autoscale_headroom_sessions']} and refusal window "
        f"{defaults['autoscale_refusal_window_s']:g} s (defaults), cool-down "
        f"{cfg['autoscale_cooldown_s']:g} s, a replica removed after "
        f"{cfg['autoscale_down_after_s']:g} s of spare headroom beyond one replica's cap. "
        f"Offered sessions step {', '.join(map(str, cfg['autoscale_levels']))}, "
        f"{cfg['autoscale_step_s']:g} s each (a step down ends the newest sessions); a "
        "refused session retries after its Retry-After until admitted or under "
        f"{autoscaling.MIN_SESSION_S:g} s of its span is left; `GET /v1/cluster` sampled "
        f"every {SAMPLE_PERIOD_S:g} s. Misses: frames the server judged late or empty.", "",
        f"![autoscaling]({AUTOSCALING_PLOT})", "",
        md_table(["step", "from s", "offered", "replicas serving", "min headroom",
                  "refusals", "frames", "misses"], rows), "",
        "Decisions (time from the load's start; took effect: the added replica serving, or "
        "the removed one drained and gone):", "",
        md_table(["t s", "decision", "reason", "headroom", "refused", "took effect s"],
                 decisions), "",
        f"Sessions: {total['sessions']} offered, {total['admitted']} admitted "
        f"({total['refused_sessions']} after at least one refusal, {total['refusals']} "
        f"refusals in all, the longest wait {fmt(total['wait_s_max'], '.1f')} s), "
        f"{total['gave_up']} gave up, {total['closed_by_server']} closed by the server (a "
        f"scale-down drains: it closes none). Frames: {total['frames']}, misses "
        f"{total['misses']} ({fmt(misses, '.2%')}).", "",
    ]


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
    plt, save = ctx.figure(FIXED_PLOT)
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


def plot_autoscaling(ctx: RunContext, auto: dict, step_s: float, levels: tuple[int, ...]
                     ) -> None:
    plt, save = ctx.figure(AUTOSCALING_PLOT)
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    samples = auto["samples"]
    t = [x["t_s"] for x in samples]

    def series(key: str) -> list[float]:
        return [math.nan if x[key] is None else x[key] for x in samples]

    ax1.step([k * step_s for k in range(len(levels) + 1)], [*levels, levels[-1]],
             where="post", label="offered", color="black")
    ax1.plot(t, series("active_sessions"), label="active")
    ax1.plot(t, series("cap"), label="fleet cap (serving replicas)")
    ax1.plot(t, series("headroom"), label="headroom (the autoscaler's)", linestyle=":")
    ax1.set_ylabel("sessions")
    ax1.legend(fontsize=8)
    ax2.plot(t, series("replicas_serving"), label="serving")
    ax2.plot(t, series("replicas_draining"), label="draining")
    ax2.step(t, series("desired_replicas"), where="post", linestyle="--",
             label="desired (autoscaler)")
    ax2.set_ylabel("replicas")
    ax2.legend(fontsize=8)
    bins = auto["binned"]
    at = [b["t_s"] + BIN_S / 2 for b in bins]
    ax3.bar(at, [b["refusals"] for b in bins], width=BIN_S * 0.45, label="refusals",
            align="edge")
    ax3.bar(at, [b["misses"] for b in bins], width=-BIN_S * 0.45, label="deadline misses",
            align="edge")
    ax3.set_xlabel("s since the load started")
    ax3.set_ylabel(f"per {BIN_S:g} s")
    ax3.legend(fontsize=8)
    save(fig)
