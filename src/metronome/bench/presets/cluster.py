"""`metronome bench cluster`: what Ray Serve (`metronome serve --replicas N`) costs and gives,
on loopback with `preset:tiny` (one torch thread per server), every server started by
`bench.server` and loaded by `metronome load`'s client.

`fixed`: (1) the proxy hop: the plain server and a 1-replica cluster, both up, loaded in
turn (`bench.steps`) at the same load, `repeats` times: client frame latency p50/p95 per run.
(2) Capacity of 1 and 2 replicas, AIMD on (its cap starting above the ladder): offered
sessions up a ladder to the first step that misses (over `miss_limit_share` of its frames,
server-side) or is refused, then bisection; a step's capacity is the sessions it admitted.
(3) Ray's footprint at 2 replicas: start, RSS of the launcher's process tree, idle CPU,
SIGTERM to exit. `autoscaling`: a `--replicas MIN..MAX` cluster (static admission, so the
autoscaler moves), offered sessions stepping up and down, refused ones retrying as their
Retry-After says; replicas, headroom, refusals and misses over time, each decision's effect
time. Derived number: sessions held by 2 replicas over 1 (fixed), else the autoscaling run's
share of frames that missed.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from metronome.bench.presets import knob
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "cluster"
MODEL = "preset:tiny"  # the 2-layer random test Llama: two replicas and Ray fit beside it
LOG_DIR = Path("out/bench-cluster")  # each server's output
MIN_SESSION_S = 3.0  # an autoscaling user with less of its span left stops retrying


@dataclass(frozen=True)
class Config:
    runs: tuple[str, ...] = knob(("fixed", "autoscaling"), "fixed and/or autoscaling")
    repeats: int = knob(5, "proxy-hop runs of each server")
    hop_sessions: int = knob(4, "sessions of each proxy-hop run")
    hop_duration_s: float = knob(15.0, "speech each proxy-hop session streams")
    ladder: tuple[int, ...] = knob((8, 12, 16, 20, 24, 28, 32, 40, 48, 56), "sessions offered")
    bisect_steps: int = knob(2, "steps between the last that held and the first that did not")
    step_duration_s: float = knob(20.0, "speech each session of a capacity step streams")
    ramp_s: float = knob(4.0, "a load's sessions start evenly over this long")
    output_tokens_per_frame: int = knob(32, "every server's (the engine must bind first)")
    miss_limit_share: float = knob(0.01, "a capacity step holds at most this share of misses")
    idle_window_s: float = knob(5.0, "the footprint's idle CPU is measured over this long")
    autoscale_replicas: str = knob("1..3", "the autoscaling run's --replicas MIN..MAX")
    autoscale_cap: int = knob(4, "the autoscaling run's sessions per replica (static)")
    autoscale_levels: tuple[int, ...] = knob((2, 6, 10, 6, 2), "sessions offered, a level a step")
    autoscale_step_s: float = knob(40.0, "each level's length")
    autoscale_cooldown_s: float = knob(5.0, "the autoscaler's cool-down")
    autoscale_down_after_s: float = knob(15.0, "the autoscaler's sustained-spare period")

    def __post_init__(self) -> None:
        if not self.runs or set(self.runs) - {"fixed", "autoscaling"}:
            raise ValueError(f"runs: fixed and/or autoscaling, got {list(self.runs)}")

    @classmethod
    def smoke(cls) -> Config:
        return cls(repeats=1, hop_sessions=1, hop_duration_s=3.0, ladder=(2,), bisect_steps=0,
                   step_duration_s=3.0, ramp_s=0.5, autoscale_replicas="1..2", autoscale_cap=1,
                   autoscale_levels=(1, 2, 0), autoscale_step_s=15.0,
                   autoscale_cooldown_s=2.0, autoscale_down_after_s=4.0)


def cluster_ready(replicas: int):
    """A cluster's readiness: `replicas` replicas reporting in `GET /v1/cluster`."""
    def ready(url: str) -> bool:
        try:
            return httpx.get(url + "/v1/cluster", timeout=2).json()["replicas_live"] == replicas
        except (httpx.HTTPError, ValueError, KeyError):
            return False
    return ready


def start(args: list[str], replicas: int | None, name: str):
    from metronome.bench.server import Server, healthy

    ready = healthy if replicas is None else cluster_ready(replicas)
    return Server.start(["--model", MODEL, *args, "--log-level", "warning"], ready,
                        LOG_DIR / f"{name}.log")


def load(server, sessions: int, duration_s: float, ramp_s: float) -> dict:
    """`metronome load`'s summary of one run against `server`, once it is idle again."""
    from metronome.load.run import LoadConfig, run_load

    with tempfile.TemporaryDirectory() as out:
        summary = asyncio.run(run_load(LoadConfig(url=server.ws_url, sessions=sessions,
                                                  ramp_s=ramp_s, duration_s=duration_s,
                                                  out=out)))
    path = "/v1/cluster" if "--replicas" in server.args else "/healthz"
    key = "active_sessions" if "--replicas" in server.args else "sessions"
    for _ in range(60):
        if not httpx.get(server.url + path, timeout=5).json()[key]:
            break
        time.sleep(0.5)
    return summary


def capacity(cfg: Config, step) -> list[dict]:
    """Up the ladder to the first step that does not hold or was refused, then bisect
    between it and the last that held, `bisect_steps` times at most; `step(offered)` is a
    row (`capacity_step`)."""
    steps = []
    for offered in cfg.ladder:
        steps.append(step(offered))
        if not steps[-1]["holds"] or steps[-1]["refused"]:
            break
    low = max([s["offered"] for s in steps if s["holds"]], default=0)
    high = steps[-1]["offered"]
    for _ in range(cfg.bisect_steps if not steps[-1]["holds"] else 0):
        if high - low <= 1:
            break
        steps.append(step((low + high) // 2))
        low, high = ((steps[-1]["offered"], high) if steps[-1]["holds"]
                     else (low, steps[-1]["offered"]))
    return steps


def capacity_step(summary: dict, offered: int, miss_limit_share: float) -> dict:
    sessions, good = summary["sessions"], summary["goodput_server"]
    miss = None if good is None else 1.0 - good
    return {"offered": offered, "refused": sessions.get("refused", 0),
            "admitted": sessions.get("completed", 0) + sessions.get("closed_by_server", 0),
            "frames": summary["frames"], "miss_share": miss,
            "client_p95_ms": summary["latency_ms"]["client"]["p95"],
            "holds": miss is not None and miss <= miss_limit_share}


def footprint(server, idle_window_s: float) -> dict:
    """RSS and idle CPU of the launcher's process tree (Ray's processes are its children)."""
    import psutil

    root = psutil.Process(server.process.pid)
    tree = [root, *root.children(recursive=True)]
    cpu = {p.pid: sum(p.cpu_times()[:2]) for p in tree if p.is_running()}
    time.sleep(idle_window_s)
    rss = sum(p.memory_info().rss for p in tree if p.is_running()) / 2**20
    used = sum(sum(p.cpu_times()[:2]) - cpu.get(p.pid, 0.0) for p in tree if p.is_running())
    return {"start_s": server.start_s, "processes": len(tree), "rss_mib": rss,
            "idle_cpu_share_of_machine": used / idle_window_s / psutil.cpu_count()}


def fixed(ctx: RunContext, cfg: Config) -> dict:
    from metronome.bench.steps import interleave

    args = ["--admission", "aimd", "--admission-cap", str(max(cfg.ladder) + 1),
            "--output-tokens-per-frame", str(cfg.output_tokens_per_frame)]
    servers = {"plain": start(args, None, "plain"),
               "ray_serve": start([*args, "--replicas", "1"], 1, "1")}
    hop: dict[str, list[dict]] = {name: [] for name in servers}
    runs = {name: (lambda s=s, name=name: hop[name].append(load(
        s, cfg.hop_sessions, cfg.hop_duration_s, cfg.ramp_s)["latency_ms"]["client"]))
        for name, s in servers.items()}
    try:
        interleave(runs, cfg.repeats, warmup=0)
    finally:
        servers.pop("plain").stop()
    ladder = []
    for replicas in (1, 2):
        server = servers["ray_serve"] if replicas == 1 else start(
            [*args, "--replicas", "2"], 2, "2")
        try:
            if replicas == 2:
                ray_footprint = footprint(server, cfg.idle_window_s)
            ladder += [{"replicas": replicas} | s for s in capacity(cfg, lambda n, s=server:
                       capacity_step(load(s, n, cfg.step_duration_s, cfg.ramp_s), n,
                                     cfg.miss_limit_share))]
            ctx.keep("capacity", ladder)
        finally:
            exit_s = server.stop()
    held = [max([s["admitted"] for s in ladder if s["replicas"] == r and s["holds"]], default=0)
            for r in (1, 2)]
    return {"hop": [{"server": name, "runs": len(rs)} | {
        f"{q}_{agg}_ms": fn([r[q] for r in rs]) for q in ("p50", "p95")
        for agg, fn in (("median", statistics.median), ("min", min))} for name, rs in hop.items()],
        "capacity": ladder, "held": [{"replicas": r, "sessions": h} for r, h in zip(
            (1, 2), held, strict=True)], "footprint": ray_footprint | {"exit_s": exit_s},
        "capacity_ratio": held[1] / held[0] if held[0] else None}


def schedule(levels: tuple[int, ...], step_s: float) -> list[tuple[float, float]]:
    """Each session's (start_s, end_s) for offered concurrency `levels`, one per step: a
    step up starts sessions at its start, a step down ends the newest ones there."""
    open_s, spans = [], []
    for k, level in enumerate(levels):
        while len(open_s) > level:
            spans.append((open_s.pop(), k * step_s))
        open_s += [k * step_s] * (level - len(open_s))
    return sorted(spans + [(start_s, len(levels) * step_s) for start_s in open_s])


async def _user(settings, index: int, span: tuple[float, float], origin_s: float,
                frames: list) -> dict:
    """A user who keeps trying: refused, it retries after the Retry-After until admitted or
    under `MIN_SESSION_S` of its span is left."""
    from metronome.load.client import SessionClient
    from metronome.load.speech import SPEECH_DIR, speech_stream

    (start_s, end_s), refused = span, []
    pcm = speech_stream(SPEECH_DIR, settings.sample_rate_hz, end_s - start_s, offset=index)
    await asyncio.sleep(max(0.0, origin_s + start_s - time.monotonic()))
    while (left_s := end_s - (time.monotonic() - origin_s)) >= MIN_SESSION_S:
        tried_s = time.monotonic() - origin_s
        client = SessionClient(settings, index, pcm[:round(left_s * settings.sample_rate_hz) * 2],
                               origin_s, frames.append)
        outcome = await client.run()
        if outcome.outcome != "refused":
            return {"start_s": start_s, "refused_at_s": refused, "admitted_at_s": tried_s,
                    "outcome": outcome.outcome}
        refused.append(tried_s)
        await asyncio.sleep(outcome.retry_after_s or 2.0)
    return {"start_s": start_s, "refused_at_s": refused, "admitted_at_s": None,
            "outcome": "gave_up"}


async def _autoscale(url: str, cfg: Config) -> dict:
    from metronome.load.client import ClientSettings
    from metronome.load.run import LoadConfig

    load_cfg, frames, samples, last = LoadConfig(), [], [], {}
    settings = ClientSettings(url.replace("http", "ws") + "/v1/realtime", load_cfg.mode,
                              load_cfg.sample_rate_hz, load_cfg.chunk_ms, None)
    origin_s, origin_wall_s = time.monotonic(), time.time()
    users = asyncio.gather(*(_user(settings, i, span, origin_s, frames) for i, span in
                             enumerate(schedule(cfg.autoscale_levels, cfg.autoscale_step_s))))
    end_s = (len(cfg.autoscale_levels) + 2) * cfg.autoscale_step_s  # then the scale-downs
    async with httpx.AsyncClient(timeout=5) as http:
        while not users.done() or time.monotonic() - origin_s < end_s:
            await asyncio.sleep(1.0)
            try:
                last = (await http.get(url + "/v1/cluster")).json()
            except (httpx.HTTPError, ValueError):
                continue
            live = [r for r in last["replicas"] if r["status"] != "unreachable"]
            serving = [r for r in live if not r["draining"]]
            auto = last.get("autoscaling") or {}
            samples.append({"t_s": round(time.monotonic() - origin_s, 2),
                            "replicas_serving": len(serving),
                            "replicas_draining": len(live) - len(serving),
                            "desired_replicas": auto.get("desired_replicas"),
                            "headroom": auto.get("headroom"),
                            "cap": sum(r["cap"] for r in serving),
                            "active_sessions": sum(r["active_sessions"] for r in live)})
    events = [e | {"t_s": round(e["at_s"] - origin_wall_s, 2)}
              for e in (last.get("autoscaling") or {}).get("events", [])]
    return {"sessions": await users, "samples": samples, "events": events,
            "frames": [{"t_s": round(f.received_at_s, 2), "good": f.good} for f in frames]}


def timeline(raw: dict, levels: tuple[int, ...], step_s: float) -> list[dict]:
    """Per step: offered, replicas serving (min..max seen), least headroom, refusals,
    frames and misses (the server's verdict) in it."""
    rows = []
    for k, offered in enumerate(levels):
        lo, hi = k * step_s, (k + 1) * step_s
        seen = [s for s in raw["samples"] if lo <= s["t_s"] < hi]
        frames = [f for f in raw["frames"] if lo <= f["t_s"] < hi]
        rows.append({"step": k, "from_s": lo, "offered": offered,
                     "replicas_min": min((s["replicas_serving"] for s in seen), default=None),
                     "replicas_max": max((s["replicas_serving"] for s in seen), default=None),
                     "headroom_min": min((s["headroom"] for s in seen
                                          if s["headroom"] is not None), default=None),
                     "refusals": sum(lo <= t < hi for u in raw["sessions"]
                                     for t in u["refused_at_s"]),
                     "frames": len(frames), "misses": sum(not f["good"] for f in frames)})
    return rows


def decisions(raw: dict) -> list[dict]:
    """The autoscaler's decisions, each with the seconds until it took effect: the serving
    replicas reached its count (up), or the removed one drained and left (down)."""
    out = []
    for e in raw["events"]:
        done = next((s["t_s"] for s in raw["samples"] if s["t_s"] >= e["t_s"] and (
            s["replicas_serving"] >= e["to"] if e["direction"] == "up" else
            s["replicas_serving"] <= e["to"] and s["replicas_draining"] == 0)), None)
        out.append({"t_s": e["t_s"], "decision": f"{e['direction']} {e['from']} -> {e['to']}",
                    "reason": e["reason"], "headroom": e["headroom"],
                    "effect_s": None if done is None else round(done - e["t_s"], 1)})
    return out


def run(ctx: RunContext, cfg: Config) -> dict:
    from importlib.metadata import version

    from metronome.bench.server import served_facts

    ctx.record(**served_facts(MODEL), ray=version("ray"))
    result: dict = {"config": asdict(cfg)}
    if "fixed" in cfg.runs:
        result |= fixed(ctx, cfg)
    if "autoscaling" in cfg.runs:
        server = start(["--admission", "static", "--admission-cap", str(cfg.autoscale_cap),
                        "--replicas", cfg.autoscale_replicas, "--replica-cpus", "0.5",
                        "--autoscale-cooldown-s", f"{cfg.autoscale_cooldown_s:g}",
                        "--autoscale-down-after-s", f"{cfg.autoscale_down_after_s:g}"],
                       1, "autoscaling")
        try:
            raw = asyncio.run(_autoscale(server.url, cfg))
        finally:
            server.stop()
        frames, users = raw["frames"], raw["sessions"]
        result |= {"samples": raw["samples"], "decisions": decisions(raw), "timeline": timeline(
            raw, cfg.autoscale_levels, cfg.autoscale_step_s), "autoscaling": {
            "command": server.command, "sessions": len(users),
            "admitted": sum(u["admitted_at_s"] is not None for u in users),
            "gave_up": sum(u["outcome"] == "gave_up" for u in users),
            "refusals": sum(len(u["refused_at_s"]) for u in users),
            "longest_wait_s": max((u["admitted_at_s"] - u["start_s"] for u in users
                                   if u["admitted_at_s"] is not None), default=None),
            "frames": len(frames), "misses": sum(not f["good"] for f in frames)}}
    auto = result.get("autoscaling")
    result["derived"] = (derived("sessions held by 2 replicas over 1", result["capacity_ratio"])
                         if "fixed" in cfg.runs else derived(
        "share of the autoscaling run's frames that missed",
        auto["misses"] / auto["frames"] if auto["frames"] else None))
    return REPORT.finish(ctx, result)


REPORT = Report("Ray Serve cluster (`metronome serve --replicas N|MIN..MAX`)", spec=".2f",
                tables=(
    Table("The proxy hop: client frame latency over the runs (ms)", "hop"),
    Table("Capacity ladder (AIMD on; rows in the order run)", "capacity", (
        ("replicas", "replicas", ""), ("offered", "offered", ""), ("admitted", "admitted", ""),
        ("refused", "refused", ""), ("frames", "frames", ""), ("misses", "miss_share", ".1%"),
        ("client p95 ms", "client_p95_ms", ".0f"), ("holds", "holds", ""))),
    Table("Sessions held", "held"),
    Table("Ray's footprint (2 replicas, idle)", "footprint"),
    Table("Autoscaling", "autoscaling"),
    Table("Autoscaling, per step", "timeline"),
    Table("The autoscaler's decisions (s from the load's start)", "decisions")),
    plots=(Plot("{stem}.png", "samples", x="t_s",
                ys=("active_sessions", "cap", "replicas_serving", "headroom")),))
report = REPORT.markdown
