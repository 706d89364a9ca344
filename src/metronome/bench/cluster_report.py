"""`metronome bench cluster`'s report: docs/results/cluster.md and its PNG, from the JSON."""

from __future__ import annotations

from pathlib import Path

from metronome.bench.cluster_bench import IDLE_S

CLOSE_REASON = """\
## Close reason on replica death
Not feasible with Ray Serve 2.60's proxy, so the client sees 1006 (no close frame, no
reason) when a replica dies mid-session; the test asserts exactly that. Why, in Ray's source
(`ray/serve/_private/`):
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
(tested: new sessions succeed on the survivor within 2 s of the kill). The reasons the
server itself gives (1001 drain timeout, 1008, 1011, 1013) pass through the proxy intact.
"""

TESTED = """\
## Failure and scale-down (tests, not this command: `tests/cluster/test_cluster.py`)
- kill -9 of a replica: its session's socket drops within 2 s (1006, see below), the other
  replica's session stays open, a new session is admitted on the survivor, and Ray's
  replacement reports in `GET /v1/cluster`;
- scale 2 -> 1 (`metronome cluster scale 1`) with a streaming session on each replica and a
  6 s drain timeout: the removed replica shows `draining`, takes none of the new sessions,
  answers its session's frames until the timeout, then sends `server_draining` and closes
  1001 "server draining: drain timeout"; the other replica's session misses no deadline.
"""

INSTALL = """\
## Install (measured once, by hand)
`pip install 'ray[serve]==2.60.0'` into the project venv: 34 s, venv 1,560 MB -> 1,903 MB
(+343 MB). It brings no torch and changes none of the server's pins (fastapi, starlette,
uvicorn, websockets, pydantic).
"""


def report(result: dict, png_name: str) -> str:
    machine, config = result["machine"], result["config"]
    lines: list[str] = [
        "# Ray Serve cluster (`metronome serve --replicas N`): cost and capacity", "",
        f"Command: `{result['command']}` ({result['elapsed_s'] / 60:.1f} min). Machine: "
        f"{machine['cpus']} CPUs, {machine['memory_gib']:.0f} GiB, Python "
        f"{machine['python']}, torch {machine['torch']}, Ray {machine['ray']} (shared with "
        "other jobs). Every server: `--model preset:tiny` (the 2-layer random test Llama), "
        f"one torch thread, {config['output_tokens_per_frame']} output tokens a frame (so the "
        "engine, not the load generator or Ray's proxy, binds first), AIMD admission "
        "starting above the ladder, on loopback; each cluster is a local Ray started "
        "by its own `metronome serve --replicas N`. Load: `metronome load` (real WebSocket "
        "clients streaming speech at real-time pace, 1 s frames) from the bench's process.",
        "", f"![proxy hop and capacity]({png_name})", "",
        *_hop(result["proxy_hop"], config), "", *_capacity(result), "",
        *_footprint(result["footprint"]), "", TESTED, INSTALL, CLOSE_REASON,
    ]
    if result["config"]["smoke"]:
        lines.insert(2, "**Smoke size: too short to mean anything; it checks the command.**\n")
    return "\n".join(lines) + "\n"


def _hop(hop: dict, config: dict) -> list[str]:
    s = hop["summary"]
    rows = [f"| {q}, {a} of runs | {s['plain'][f'{q}_{a}']:.1f} | "
            f"{s['ray_serve'][f'{q}_{a}']:.1f} | {s['added'][f'{q}_{a}']:+.1f} |"
            for q in ("p50", "p95") for a in ("median", "min")]
    return [
        "## The proxy hop", f"{hop['sessions']} sessions x {hop['duration_s']:g} s of speech "
        f"against the plain `metronome serve` and a 1-replica cluster, both running the "
        f"whole time, alternately, {config['repeats']} runs each; client-observed frame "
        "latency (frame end to its result at the client), per-run percentiles, then the "
        "median and the min over the runs.", "",
        "| frame latency, ms | plain server | through Ray Serve | added |",
        "|---|---|---|---|", *rows, "",
        "Per run (p50 / p95 ms): plain " + ", ".join(
            f"{r['p50_ms']:.1f} / {r['p95_ms']:.1f}" for r in hop["runs"]["plain"])
        + "; Ray Serve " + ", ".join(
            f"{r['p50_ms']:.1f} / {r['p95_ms']:.1f}" for r in hop["runs"]["ray_serve"]) + ".",
    ]


def _capacity(result: dict) -> list[str]:
    lines = ["## Capacity: 1 vs 2 replicas", "Sessions held at <= 1 % deadline misses "
             "(server-side, over the admitted sessions' frames), AIMD on, one torch thread "
             "per replica; the ladder of offered sessions stops at the first step that does "
             "not hold or where admission refused, then bisects between it and the last "
             "step that held (rows in the order run).", "",
             "| replicas | offered | admitted | refused | frames | misses | client p95 ms |"
             " holds |", "|---|---|---|---|---|---|---|---|"]
    for cap in result["capacity"]:
        for s in cap["steps"]:
            miss = "-" if s["miss_share"] is None else f"{s['miss_share']:.1%}"
            p95 = "-" if s["client_p95_ms"] is None else f"{s['client_p95_ms']:.0f}"
            lines.append(f"| {cap['replicas']} | {s['offered']} | {s['admitted']} | "
                         f"{s['refused']} | {s['frames']} | {miss} | {p95} | "
                         f"{'yes' if s['holds'] else 'no'} |")
    held = [c["held_sessions"] for c in result["capacity"]]
    ratio = result["capacity_ratio"]
    if not any(s["refused"] for c in result["capacity"] for s in c["steps"]):
        lines += ["", "AIMD refused no session in any step: a step's sessions all arrive "
                  "within its ramp, faster than AIMD's control interval (2 s) reacts, so "
                  "the ladder, not AIMD's cap, found these numbers."]
    lines += ["", f"Held: {held[0]} sessions with 1 replica, {held[1]} with 2: "
              + (f"{ratio:.2f}x (goal >= 1.8x)." if ratio else "no ratio (1 replica held none).")
              + f" The machine's {result['machine']['cpus']} CPUs also run Ray's proxy (every "
              "message of every session passes through it), Ray's own processes and the load "
              "generator: two one-thread replicas double what one holds only where those "
              "fit beside them."]
    return lines


def _footprint(fp: dict) -> list[str]:
    by_name = ", ".join(f"{name} {mib:.0f}" for name, mib in fp["rss_mib_by_process"].items())
    return [
        "## Ray's footprint (2 replicas, idle)", "| what | measured |", "|---|---|",
        f"| start (command to both replicas in `GET /v1/cluster`) | {fp['start_s']:.1f} s |",
        f"| RSS, the launcher's whole process tree ({fp['processes']} processes) | "
        f"{fp['rss_mib']:,.0f} MiB: {by_name} |",
        f"| CPU while idle ({IDLE_S:g} s) | {fp['idle_cpu_share_of_machine']:.1%} of the machine |",
        f"| SIGTERM to exit | {fp['exit_s']:.1f} s |",
        "", "RSS counts shared pages (Ray's object store, the replicas' torch) once per "
        "process, so it overstates what the tree takes together.",
    ]


def plot(result: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    s = result["proxy_hop"]["summary"]
    for offset, (name, label) in enumerate((("plain", "plain server"),
                                            ("ray_serve", "through Ray Serve"))):
        values = [s[name]["p50_median"], s[name]["p95_median"]]
        ax1.bar([i + 0.38 * offset for i in (0, 1)], values, width=0.36, label=label)
    ax1.set_xticks([0.19, 1.19], ["p50", "p95"])
    ax1.set_ylabel("client frame latency, ms (median of runs)")
    ax1.set_title("the proxy hop")
    ax1.legend(fontsize=8)
    for cap in result["capacity"]:
        steps = cap["steps"]
        ax2.plot([st["offered"] for st in steps], [st["admitted"] for st in steps],
                 marker="o", label=f"{cap['replicas']} replica(s), held {cap['held_sessions']}")
    ax2.set_xlabel("sessions offered")
    ax2.set_ylabel("sessions admitted")
    ax2.set_title("capacity (AIMD on, <= 1 % misses)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
