"""`metronome bench soak`: does `metronome serve` (one torch thread) stay flat while `metronome
load` churns sessions (Poisson, about `sessions` at once) beside one bad client? Every
`sample_s` and once idle again: RSS, open fds, threads, KV blocks in use. Flat: RSS from the
first to the last quarter within max(16 MiB, 2 %), idle fds back (+2), no block held when
idle. Derived number: that RSS growth, in MiB.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import httpx
import psutil

from metronome.bench.presets import Knobs, knob
from metronome.bench.server import Server, served_facts
from metronome.load.client import BAD_KINDS, misbehave
from metronome.load.run import LoadConfig, run_load
from metronome.load.speech import SPEECH_DIR, speech_stream
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "soak"


@dataclass(frozen=True)
class Config(Knobs):
    duration_s: float = knob(1800.0, "how long sessions keep arriving")
    sessions: int = knob(3, "good sessions at once, on average (plus one bad client)")
    session_s: float = knob(6.0, "speech each good session streams")
    model: str = knob("bundled", "'bundled', a HF directory, or preset:NAME[:L]")
    pool_tokens: int = knob(8192, "the server's KV pool in tokens")
    sample_s: float = knob(5.0, "seconds between samples")
    idle_timeout_s: float = knob(5.0, "the server's idle timeout (closes the silent client)")

    SMOKE = dict(duration_s=6.0, sessions=2, sample_s=1.0)


async def bad_client(url: str, stop_at: float, outcomes: dict) -> None:
    """The load client's bad sessions, one kind after another, until `stop_at`."""
    chunk, turn = speech_stream(SPEECH_DIR, 24000, 0.1), 0
    while time.monotonic() < stop_at:
        kind, turn = BAD_KINDS[turn % len(BAD_KINDS)], turn + 1
        key = f"bad {kind}: {await misbehave(url, kind, chunk)}"
        outcomes[key] = outcomes.get(key, 0) + 1


async def soak(cfg: Config, server) -> dict:
    process, samples, outcomes = psutil.Process(server.process.pid), [], {}

    async def sample(t_s: float, phase: str) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            health = (await http.get(server.url + "/healthz")).json()
        samples.append({"t_s": round(t_s, 1), "phase": phase,
                        "rss_mib": process.memory_info().rss / 2**20,
                        "open_fds": process.num_fds(), "threads": process.num_threads(),
                        "used_blocks": health["kv_pool"]["used_blocks"],
                        "sessions": health["sessions"]})

    for _ in range(3):
        await sample(-1.0, "idle_start")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as out:
        load = asyncio.create_task(run_load(LoadConfig(
            url=server.ws_url, sessions=max(1, round(cfg.sessions * cfg.duration_s
                                                     / cfg.session_s)),
            ramp_s=cfg.duration_s, arrival="poisson", duration_s=cfg.session_s, out=out)))
        bad = asyncio.create_task(bad_client(server.ws_url, started + cfg.duration_s, outcomes))
        while not (load.done() and bad.done()):
            await asyncio.sleep(cfg.sample_s)
            await sample(time.monotonic() - started, "load")
        summary = await load
    for _ in range(60):  # until idle: every session gone (the silent one by the idle timeout)
        await sample(time.monotonic() - started, "idle_end")
        if not samples[-1]["sessions"] and not samples[-1]["used_blocks"]:
            break
        await asyncio.sleep(0.5)
    return {"samples": samples, "clients": [{"what": f"{kind} {k}", "count": n} for kind, d in (
        ("good sessions", summary["sessions"]), ("good frames", summary["frames_by_status"]),
        ("errors", summary["errors"])) for k, n in d.items()]
        + [{"what": k, "count": n} for k, n in sorted(outcomes.items())]}


def verdict(samples: list[dict], duration_s: float) -> list[dict]:
    """Flat or not, for RSS, fds and blocks, with the numbers behind each."""
    load = [s for s in samples if s["phase"] == "load"]
    steady = [s for s in load if s["t_s"] >= min(60.0, 0.1 * duration_s)] or load
    q = max(1, len(steady) // 4)
    rss = [statistics.median(s["rss_mib"] for s in part) for part in (steady[:q], steady[-q:])]
    first, last = samples[0], samples[-1]  # idle before, idle after
    return [{"what": "server RSS MiB (first / last quarter)", "start": rss[0], "end": rss[1],
             "allowed": max(16.0, 0.02 * rss[0]),
             "flat": abs(rss[1] - rss[0]) <= max(16.0, 0.02 * rss[0])}] + [
        {"what": f"{key} (idle before / after)", "start": first[key], "end": last[key],
         "allowed": allowed, "flat": None if allowed is None else last[key] <= (
             first[key] if key == "open_fds" else 0) + allowed}
        for key, allowed in (("open_fds", 2), ("used_blocks", 0), ("threads", None))]


def run(ctx: RunContext, cfg: Config) -> dict:
    ctx.record(**served_facts(cfg.model), nice=os.nice(0))
    with Server.start(["--model", cfg.model, "--pool-tokens", str(cfg.pool_tokens),
                       "--admission", "off", "--idle-timeout-s", f"{cfg.idle_timeout_s:g}",
                       "--log-level", "warning"], timeout_s=300.0) as server:
        result = asyncio.run(soak(cfg, server))
    flat = verdict(result["samples"], cfg.duration_s)
    return REPORT.finish(ctx, result | {
        "config": asdict(cfg), "server": {"command": server.command}, "verdict": flat,
        "derived": derived("server RSS growth, first to last quarter of the run (MiB)",
                           flat[0]["end"] - flat[0]["start"])})


REPORT = Report("Soak: does `metronome serve` stay flat under churning sessions?", spec="+.1f",
                tables=(Table("Verdict", "verdict"), Table("The server", "server"),
                        Table("What the clients saw", "clients")),
                plots=(Plot("{stem}.png", "samples", x="t_s",
                            ys=("rss_mib", "open_fds", "used_blocks")),))
report = REPORT.markdown
