"""`metronome bench cluster`: Ray Serve (`metronome serve --replicas N`) on loopback with
`preset:tiny`, loaded by `metronome load`'s client. `fixed`: the proxy hop (plain server vs
1-replica cluster, in turn); capacity of 1 and 2 replicas (AIMD on; a ladder of offered
sessions up to the first step that misses over `miss_limit_share` or is refused).
`autoscaling`: MIN..MAX replicas, offered sessions stepping up and down, refused users
retrying. Derived number: sessions 2 replicas held over 1's (else the share of frames missed).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from metronome.bench.presets import Knobs, knob
from metronome.bench.server import Server, healthy, served_facts
from metronome.bench.steps import interleave
from metronome.load.client import ClientSettings, persistent
from metronome.load.run import LoadConfig, run_load
from metronome.load.speech import SPEECH_DIR, speech_stream
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "cluster"
MODEL = "preset:tiny"  # the 2-layer random test Llama: two replicas and Ray fit beside it
LOG_DIR = Path("out/bench-cluster")  # each server's output


@dataclass(frozen=True)
class Config(Knobs):
    runs: tuple[str, ...] = knob(("fixed", "autoscaling"), "fixed and/or autoscaling")
    repeats: int = knob(5, "proxy-hop runs of each server")
    hop_sessions: int = knob(4, "sessions of each proxy-hop run")
    hop_duration_s: float = knob(15.0, "speech each proxy-hop session streams")
    ladder: tuple[int, ...] = knob((8, 12, 16, 20, 24, 28, 32, 40, 48, 56), "sessions offered")
    step_duration_s: float = knob(20.0, "speech each session of a capacity step streams")
    ramp_s: float = knob(4.0, "a load's sessions start evenly over this long")
    output_tokens_per_frame: int = knob(32, "every server's (the engine must bind first)")
    miss_limit_share: float = knob(0.01, "a capacity step holds at most this share of misses")
    autoscale_replicas: str = knob("1..3", "the autoscaling run's --replicas MIN..MAX")
    autoscale_cap: int = knob(4, "the autoscaling run's sessions per replica (static)")
    autoscale_levels: tuple[int, ...] = knob((2, 6, 10, 6, 2), "sessions offered, a level a step")
    autoscale_step_s: float = knob(40.0, "each level's length")
    autoscale_cooldown_s: float = knob(5.0, "the autoscaler's cool-down")
    autoscale_down_after_s: float = knob(15.0, "the autoscaler's sustained-spare period")

    def __post_init__(self) -> None:
        if not self.runs or set(self.runs) - {"fixed", "autoscaling"}:
            raise ValueError(f"runs: fixed and/or autoscaling, got {list(self.runs)}")

    SMOKE = dict(repeats=1, hop_sessions=1, hop_duration_s=3.0, ladder=(2,),
                 step_duration_s=3.0, ramp_s=0.5, autoscale_replicas="1..2", autoscale_cap=1,
                 autoscale_levels=(1, 2, 0), autoscale_step_s=15.0,
                 autoscale_cooldown_s=2.0, autoscale_down_after_s=4.0)


def start(args: list[str], replicas: int | None, name: str):
    """A plain server (`replicas` None) or a cluster, ready once its replicas report in."""
    def ready(url: str) -> bool:
        return healthy(url) and (replicas is None or httpx.get(
            url + "/v1/cluster", timeout=2).json().get("replicas_live") == replicas)

    return Server.start(["--model", MODEL, *args, "--log-level", "warning"], ready,
                        LOG_DIR / f"{name}.log")


def load(server, sessions: int, duration_s: float, ramp_s: float) -> dict:
    """`metronome load`'s summary of one run against `server`, once it is idle again."""
    with tempfile.TemporaryDirectory() as out:
        summary = asyncio.run(run_load(LoadConfig(url=server.ws_url, sessions=sessions,
                                                  ramp_s=ramp_s, duration_s=duration_s,
                                                  out=out)))
    path, key = (("/v1/cluster", "active_sessions") if "--replicas" in server.args
                 else ("/healthz", "sessions"))
    for _ in range(60):
        if not httpx.get(server.url + path, timeout=5).json()[key]:
            break
        time.sleep(0.5)
    return summary


def ladder_steps(cfg: Config, load_step) -> list[dict]:
    """Up the ladder to the first step that does not hold (over `miss_limit_share` of its
    frames missed, server-side) or where admission refused; `load_step(n)`: a load summary."""
    steps = []
    for offered in cfg.ladder:
        summary = load_step(offered)
        sessions, good = summary["sessions"], summary["goodput_server"]
        steps.append({"offered": offered, "refused": sessions.get("refused", 0),
                      "admitted": sessions.get("completed", 0)
                      + sessions.get("closed_by_server", 0), "frames": summary["frames"],
                      "miss_share": None if good is None else 1 - good,
                      "client_p95_ms": summary["latency_ms"]["client"]["p95"]})
        steps[-1]["holds"] = good is not None and 1 - good <= cfg.miss_limit_share
        if not steps[-1]["holds"] or steps[-1]["refused"]:
            break
    return steps


def fixed(ctx: RunContext, cfg: Config) -> dict:
    args = ["--admission", "aimd", "--admission-cap", str(max(cfg.ladder) + 1),
            "--output-tokens-per-frame", str(cfg.output_tokens_per_frame)]
    plain, one = start(args, None, "plain"), start([*args, "--replicas", "1"], 1, "1")
    hop = {"plain": [], "ray_serve": []}
    try:
        interleave({name: lambda s=s, name=name: hop[name].append(load(
            s, cfg.hop_sessions, cfg.hop_duration_s, cfg.ramp_s)["latency_ms"]["client"])
            for name, s in (("plain", plain), ("ray_serve", one))}, cfg.repeats, warmup=0)
    finally:
        plain.stop()
    capacity = []
    for replicas in (1, 2):
        server = one if replicas == 1 else start([*args, "--replicas", "2"], 2, "2")
        with server:
            capacity += [{"replicas": replicas, "start_s": server.start_s} | s for s in
                         ladder_steps(cfg, lambda n, s=server: load(s, n, cfg.step_duration_s,
                                                                    cfg.ramp_s))]
            ctx.keep("capacity", capacity)
    held = [max([s["admitted"] for s in capacity if s["replicas"] == r and s["holds"]],
                default=0) for r in (1, 2)]
    return {"hop": [{"server": name} | {f"{q}_{agg}_ms": fn([r[q] for r in runs])
                                        for q in ("p50", "p95") for agg, fn in (
                                            ("median", statistics.median), ("min", min))}
                    for name, runs in hop.items()], "capacity": capacity,
            "capacity_ratio": held[1] / held[0] if held[0] else None}


def schedule(levels: tuple[int, ...], step_s: float) -> list[tuple[float, float]]:
    """Sessions' (start_s, end_s) for `levels` of offered concurrency, one a step (a step
    down ends the newest)."""
    open_s, spans = [], []
    for k, level in enumerate(levels):
        while len(open_s) > level:
            spans.append((open_s.pop(), k * step_s))
        open_s += [k * step_s] * (level - len(open_s))
    return sorted(spans + [(start_s, len(levels) * step_s) for start_s in open_s])


async def autoscaling(url: str, cfg: Config) -> dict:
    lc, frames, samples, last = LoadConfig(), [], [], {}
    settings = ClientSettings(url.replace("http", "ws") + "/v1/realtime", lc.mode,
                              lc.sample_rate_hz, lc.chunk_ms, None)
    origin_s, wall_s = time.monotonic(), time.time()
    users = asyncio.gather(*(persistent(settings, i, speech_stream(
        SPEECH_DIR, lc.sample_rate_hz, end_s - start_s, offset=i), origin_s, (start_s, end_s),
        frames.append) for i, (start_s, end_s) in enumerate(schedule(
            cfg.autoscale_levels, cfg.autoscale_step_s))))
    end_s = (len(cfg.autoscale_levels) + 2) * cfg.autoscale_step_s  # then the scale-downs
    async with httpx.AsyncClient(timeout=5) as http:
        while not users.done() or time.monotonic() - origin_s < end_s:
            await asyncio.sleep(1.0)
            try:
                last = (await http.get(url + "/v1/cluster")).json()
            except (httpx.HTTPError, ValueError):
                continue
            serving = [r for r in last["replicas"] if r["status"] != "unreachable"
                       and not r["draining"]]
            samples.append({"t_s": round(time.monotonic() - origin_s, 1),
                            "replicas_serving": len(serving),
                            "draining": sum(r["draining"] for r in last["replicas"]),
                            "headroom": (last.get("autoscaling") or {}).get("headroom"),
                            "cap": sum(r["cap"] for r in serving),
                            "active_sessions": last["active_sessions"]})
    decisions = []  # each with the seconds until the replicas serving (and draining) say so
    for e in (last.get("autoscaling") or {}).get("events", []):
        t_s = e["at_s"] - wall_s
        done = next((s["t_s"] for s in samples if s["t_s"] >= t_s and (
            s["replicas_serving"] >= e["to"] if e["direction"] == "up" else
            s["replicas_serving"] <= e["to"] and not s["draining"])), None)
        decisions.append({"t_s": round(t_s, 1), "decision": f"{e['from']} -> {e['to']}",
                          "reason": e["reason"], "effect_s": done and round(done - t_s, 1)})
    users = await users
    return {"samples": samples, "decisions": decisions, "users": users, "autoscaling": {
        "sessions": len(users), "gave_up": sum(u["outcome"] == "gave_up" for u in users),
        "refusals": sum(u["refusals"] for u in users), "frames": len(frames),
        "longest_wait_s": max([u["wait_s"] or 0 for u in users], default=None),
        "misses": sum(not f.good for f in frames)}}


def run(ctx: RunContext, cfg: Config) -> dict:
    from importlib.metadata import version

    ctx.record(**served_facts(MODEL), ray=version("ray"))
    result: dict = {"config": asdict(cfg)}
    if "fixed" in cfg.runs:
        result |= fixed(ctx, cfg)
    if "autoscaling" in cfg.runs:
        with start(["--admission", "static", "--admission-cap", str(cfg.autoscale_cap),
                    "--replicas", cfg.autoscale_replicas, "--replica-cpus", "0.5",
                    "--autoscale-cooldown-s", f"{cfg.autoscale_cooldown_s:g}",
                    "--autoscale-down-after-s", f"{cfg.autoscale_down_after_s:g}"],
                   1, "autoscaling") as server:
            result |= asyncio.run(autoscaling(server.url, cfg))
            result["autoscaling"]["command"] = server.command
    auto = result.get("autoscaling") or {}
    result["derived"] = (derived("sessions held by 2 replicas over 1", result["capacity_ratio"])
                         if "fixed" in cfg.runs else derived(
        "share of the autoscaling run's frames that missed",
        auto["misses"] / auto["frames"] if auto.get("frames") else None))
    return REPORT.finish(ctx, result)


REPORT = Report("Ray Serve cluster (`metronome serve --replicas N|MIN..MAX`)", spec=".2f",
                tables=(Table("The proxy hop: client frame latency over the runs (ms)", "hop"),
                        Table("Capacity (AIMD on), step by step", "capacity"),
                        Table("Autoscaling", "autoscaling"),
                        Table("The autoscaler's decisions (s from the load's start)",
                              "decisions")),
                plots=(Plot("{stem}.png", "samples", x="t_s",
                            ys=("active_sessions", "cap", "replicas_serving")),))
report = REPORT.markdown
