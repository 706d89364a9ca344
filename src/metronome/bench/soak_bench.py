"""`metronome bench soak`: does the server stay flat over a long run of churning sessions?

Starts `metronome serve` in a subprocess (OpenMP on one thread: the soak measures
flatness, not latency), then keeps a few good clients churning for `duration_s` (open,
stream speech at real-time pace for a few seconds, close, repeat) beside one bad client
(disconnects mid-stream, malformed events, oversized text, audio faster than real time
without reading, silence). Every `sample_s` it samples the server process's resident
memory, open file descriptors and threads, and the KV pool's used blocks (`/metrics`);
once the clients stop, it waits for the server to be idle and samples again. The verdict
compares the run's end with its start, after a warm-up: RSS within `max(16 MiB, 2 %)`, the
idle fd count back where it started, no KV block held once every session has closed.

The report (and its plot) reads only the result. `duration_s` of a few seconds is the smoke
size a test runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from metronome.bench.served.server import ServerProcess, served_facts
from metronome.load.speech import SPEECH_DIR, speech_stream
from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import with_extensions

NAME = "soak"
RATE_HZ = 24000
CHUNK_S = 0.1
STARTUP_TIMEOUT_S = 300.0  # a first start converts the bundled model
BAD_KINDS = ("abrupt", "garbage", "oversized_text", "no_read", "silent")
FDS_ALLOWED_GROWTH = 2  # idle fds may end this many above where they started


@dataclass(frozen=True)
class Config:
    duration_s: float = field(default=1800.0, metadata={
        "help": "how long clients churn (a few seconds: the smoke size)"})
    sessions: int = field(default=3, metadata={
        "help": "good clients at once (plus one bad client)"})
    model: str = field(default="bundled", metadata={
        "help": "'bundled', a HF directory, or preset:NAME[:L]"})
    pool_tokens: int = field(default=8192, metadata={"help": "the server's KV pool in tokens"})
    sample_s: float = field(default=5.0, metadata={"help": "seconds between samples"})
    session_s: tuple[float, float] = field(default=(3.0, 10.0), metadata={
        "help": "each good session streams between these many seconds"})
    idle_timeout_s: float = field(default=5.0, metadata={
        "help": "the server's idle timeout (closes the silent bad client)"})

    def __post_init__(self) -> None:
        if self.duration_s < 1.0 or self.sessions < 1 or self.pool_tokens < 16 or (
                self.sample_s < 0.1) or not 0 < self.session_s[0] <= self.session_s[1]:
            raise ValueError(f"need duration_s >= 1, sessions >= 1, pool_tokens >= 16, "
                             f"sample_s >= 0.1 and 0 < session_s[0] <= session_s[1]: {self}")

    @classmethod
    def smoke(cls) -> Config:
        return cls(duration_s=6.0, sessions=2, sample_s=1.0)

    def server_config(self) -> ServerConfig:
        return ServerConfig(model=self.model, pool_tokens=self.pool_tokens, admission="off",
                            idle_timeout_s=self.idle_timeout_s)

    def serve_args(self) -> list[str]:
        return ["--model", self.model, "--pool-tokens", str(self.pool_tokens),
                "--admission", "off", "--idle-timeout-s", f"{self.idle_timeout_s:g}",
                "--log-level", "warning"]


@dataclass
class Sample:
    t_s: float  # since the clients started (negative: before them)
    phase: str  # idle_start | load | idle_end
    rss_mib: float
    open_fds: int
    threads: int
    used_blocks: float
    free_blocks: float
    sessions_active: float
    health: str


@dataclass
class ClientCounts:
    by_outcome: Counter = field(default_factory=Counter)
    frames: Counter = field(default_factory=Counter)  # metronome.frame statuses
    errors: Counter = field(default_factory=Counter)  # error event codes


def run(ctx: RunContext, cfg: Config) -> dict:
    """The whole soak: server up, clients churning, samples, verdict, plot."""
    ctx.record(**served_facts(cfg.server_config()), nice=os.nice(0))
    server = ServerProcess.start(cfg.serve_args(), timeout_s=STARTUP_TIMEOUT_S)
    try:
        result = asyncio.run(_soak(cfg, ctx.seed, server.process.pid, server.url,
                                   with_extensions(server.ws_url)))  # metronome.frame too
    finally:
        server.stop()
    ctx.record(load_avg_1m_end=round(os.getloadavg()[0], 2))
    result |= {"config": asdict(cfg), "server_command": server.command,
               "bad_kinds": list(BAD_KINDS)}
    result["verdict"] = verdict(result["samples"], cfg)
    plot(ctx, result["samples"])
    return result


async def _soak(config: Config, seed: int, pid: int, base: str, url: str) -> dict:
    process = psutil.Process(pid)
    counts = ClientCounts()
    rng = random.Random(seed)
    speech = speech_stream(SPEECH_DIR, RATE_HZ, 30.0)
    samples: list[Sample] = []
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        for _ in range(3):
            samples.append(await _sample(process, http, -1.0, "idle_start"))
        started = time.monotonic()
        stop_at = started + config.duration_s
        loops = [asyncio.create_task(_good_loop(url, speech, rng, counts, stop_at, config))
                 for _ in range(config.sessions)]
        loops.append(asyncio.create_task(_bad_loop(url, speech, rng, counts, stop_at)))
        while time.monotonic() < stop_at:
            await asyncio.sleep(min(config.sample_s, max(0.0, stop_at - time.monotonic())))
            samples.append(await _sample(process, http, time.monotonic() - started, "load"))
        await asyncio.gather(*loops)
        await _wait_idle(http)
        for _ in range(3):
            samples.append(await _sample(process, http, time.monotonic() - started,
                                         "idle_end"))
    return {"samples": [asdict(s) for s in samples], "clients": {
        "sessions": dict(counts.by_outcome), "frames": dict(counts.frames),
        "errors": dict(counts.errors)}, "clients_s": time.monotonic() - started}


# ---- clients --------------------------------------------------------------------------------
def _append(pcm: bytes) -> str:
    return json.dumps({"type": "input_audio_buffer.append",
                       "audio": base64.b64encode(pcm).decode()})


def _chunks(speech: bytes, seconds: float, rng: random.Random) -> list[bytes]:
    size = int(RATE_HZ * CHUNK_S) * 2
    start = rng.randrange(0, len(speech) // size - int(seconds / CHUNK_S) - 1) * size
    return [speech[start + k * size: start + (k + 1) * size]
            for k in range(int(seconds / CHUNK_S))]


async def _read(ws, counts: ClientCounts) -> None:
    try:
        async for message in ws:
            event = json.loads(message)
            if event["type"] == "metronome.frame":
                counts.frames[event["frame"]["status"]] += 1
            elif event["type"] == "error":
                counts.errors[event["error"]["code"]] += 1
    except ConnectionClosed:
        return


async def _good_loop(url, speech, rng, counts, stop_at: float, config: Config) -> None:
    while time.monotonic() < stop_at:
        seconds = rng.uniform(*config.session_s)
        outcome = await _guarded(_good_session(url, _chunks(speech, seconds, rng), counts))
        counts.by_outcome[f"good:{outcome}"] += 1
        await asyncio.sleep(rng.uniform(0.1, 1.0))


async def _good_session(url: str, chunks: list[bytes], counts: ClientCounts) -> str:
    async with connect(url, open_timeout=10, max_size=None) as ws:
        await ws.recv()  # session.created
        reader = asyncio.create_task(_read(ws, counts))
        begin = asyncio.get_running_loop().time()
        for k, chunk in enumerate(chunks):
            await ws.send(_append(chunk))
            await asyncio.sleep(max(0.0, begin + (k + 1) * CHUNK_S
                                    - asyncio.get_running_loop().time()))
        await asyncio.sleep(1.5)  # the last frames' answers
        reader.cancel()
    return "completed"


async def _bad_loop(url, speech, rng, counts, stop_at: float) -> None:
    turn = 0
    while time.monotonic() < stop_at:
        kind = BAD_KINDS[turn % len(BAD_KINDS)]
        turn += 1
        outcome = await _guarded(_bad_session(kind, url, speech, rng, counts))
        counts.by_outcome[f"bad_{kind}:{outcome}"] += 1
        await asyncio.sleep(rng.uniform(0.2, 1.0))


async def _bad_session(kind: str, url: str, speech: bytes, rng: random.Random,
                       counts: ClientCounts) -> str:
    ws = await connect(url, open_timeout=10, max_size=None)
    try:
        await ws.recv()
        if kind == "abrupt":  # stream a little, then vanish without a close frame
            for chunk in _chunks(speech, 1.5, rng):
                await ws.send(_append(chunk))
                await asyncio.sleep(CHUNK_S)
            ws.transport.abort()
            return "aborted"
        if kind == "garbage":
            for message in ("{not json", json.dumps({"type": "nope"}), b"\x00\x01",
                            json.dumps({"type": "session.update", "session": {"x": 1}})):
                await ws.send(message)
            await asyncio.sleep(0.5)
        elif kind == "oversized_text":  # over the queued-input bound, and over the size cap
            text = "\u00e9\u4e16\U0001f600 " * 2000
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": "A" * (2 << 20)}))
            await asyncio.sleep(0.5)
        elif kind == "no_read":  # 6 s of audio at once, never reading the answers
            for chunk in _chunks(speech, 6.0, rng):
                await ws.send(_append(chunk))
            await asyncio.sleep(2.0)
            ws.transport.abort()
            return "aborted"
        elif kind == "silent":  # says nothing until the server's idle timeout closes it
            await asyncio.wait_for(_read(ws, counts), timeout=15)
            return "closed_by_server"
        await _read_for(ws, counts, 0.5)
        await ws.close()
        return "completed"
    finally:
        if ws.transport is not None and not ws.transport.is_closing():
            ws.transport.abort()


async def _read_for(ws, counts: ClientCounts, seconds: float) -> None:
    try:
        await asyncio.wait_for(_read(ws, counts), timeout=seconds)
    except TimeoutError:
        return


async def _guarded(session) -> str:
    try:
        return await session
    except InvalidStatus as err:
        return f"refused_{err.response.status_code}"
    except (ConnectionClosed, OSError, TimeoutError) as err:
        return type(err).__name__


# ---- sampling -------------------------------------------------------------------------------
async def _sample(process: psutil.Process, http: httpx.AsyncClient, t_s: float,
                  phase: str) -> Sample:
    metrics = _metrics((await http.get("/metrics")).text)
    health = (await http.get("/healthz")).json()["status"]
    return Sample(round(t_s, 2), phase, process.memory_info().rss / (1 << 20),
                  process.num_fds(), process.num_threads(),
                  metrics.get(("metronome_kv_pool_blocks", "used"), float("nan")),
                  metrics.get(("metronome_kv_pool_blocks", "free"), float("nan")),
                  metrics.get(("metronome_sessions_active", ""), float("nan")), health)


def _metrics(text: str) -> dict[tuple[str, str], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, s.labels.get("state", ""))] = s.value
    return values


async def _wait_idle(http: httpx.AsyncClient, timeout_s: float = 30.0) -> None:
    """Until the server holds no session (every client has gone, the silent one by its
    idle timeout) and its pool reading says so."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = (await http.get("/healthz")).json()
        if health["sessions"] == 0 and health["kv_pool"]["used_blocks"] == 0:
            return
        await asyncio.sleep(0.5)


# ---- the verdict ------------------------------------------------------------------------------
def verdict(samples: list[dict], config: Config) -> dict:
    """Flat or not, for RSS, fds and blocks, with the numbers behind each."""
    load = [s for s in samples if s["phase"] == "load"]
    warm_s = min(60.0, 0.1 * config.duration_s)
    steady = [s for s in load if s["t_s"] >= warm_s] or load
    quarter = max(1, len(steady) // 4)
    rss_start = statistics.median(s["rss_mib"] for s in steady[:quarter])
    rss_end = statistics.median(s["rss_mib"] for s in steady[-quarter:])
    rss_allowed = max(16.0, 0.02 * rss_start)
    idle_start = [s for s in samples if s["phase"] == "idle_start"]
    idle_end = [s for s in samples if s["phase"] == "idle_end"]
    fds_start, fds_end = idle_start[-1]["open_fds"], idle_end[-1]["open_fds"]
    used_end = idle_end[-1]["used_blocks"]
    return {
        "warm_up_s": warm_s,
        "rss": {"start_mib": rss_start, "end_mib": rss_end, "growth_mib": rss_end - rss_start,
                "allowed_mib": rss_allowed, "max_mib": max(s["rss_mib"] for s in samples),
                "slope_mib_per_h": _slope([(s["t_s"], s["rss_mib"]) for s in steady]),
                "flat": abs(rss_end - rss_start) <= rss_allowed},
        "fds": {"idle_start": fds_start, "idle_end": fds_end,
                "max_under_load": max(s["open_fds"] for s in load),
                "allowed_growth": FDS_ALLOWED_GROWTH,
                "flat": fds_end <= fds_start + FDS_ALLOWED_GROWTH},
        "blocks": {"max_used_under_load": max(s["used_blocks"] for s in load),
                   "used_when_idle_at_end": used_end, "flat": used_end == 0},
        "threads": {"idle_start": idle_start[-1]["threads"],
                    "idle_end": idle_end[-1]["threads"]},
    }


def _slope(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 2:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return None if var == 0 else cov / var * 3600


# ---- output: the plot in the run, the report from the result alone ---------------------------
def plot(ctx: RunContext, samples: list[dict]) -> None:
    plt, save = ctx.figure("soak.png")
    t = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    for ax, key, label in zip(axes, ("rss_mib", "open_fds", "used_blocks"),
                              ("server RSS (MiB)", "open fds", "KV blocks used"), strict=True):
        ax.plot(t, [s[key] for s in samples], ".-", ms=3)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(bottom=0)
    axes[-1].set_xlabel("minutes since the clients started (before 0: idle; last: idle again)")
    fig.suptitle("metronome bench soak: churning sessions against metronome serve")
    save(fig)


def report(result: dict) -> str:
    v, c, cfg, prov = result["verdict"], result["clients"], result["config"], result["provenance"]
    rss, fds, blocks = v["rss"], v["fds"], v["blocks"]
    yes = {True: "flat", False: "NOT flat"}
    slope = rss["slope_mib_per_h"]
    nice = f"nice -n {prov['nice']} " if prov["nice"] else ""
    low_s, high_s = cfg["session_s"]
    lines = [
        "# Soak: does `metronome serve` stay flat under churning sessions?", "",
        describe(prov), "",
        f"Command: `{nice}{result['command']}` (the server: `{result['server_command']}`), "
        f"{result['clients_s'] / 60:.1f} min of clients. The bench ran at nice {prov['nice']} "
        f"(1-min load {prov['machine']['load_avg_1m_start']:.1f} at the start, "
        f"{prov['load_avg_1m_end']:.1f} at the end), so this measures flatness, not "
        "latency.", "",
        f"Clients: {cfg['sessions']} good clients churning (open, stream speech at real-time "
        f"pace for {low_s:g}-{high_s:g} s, close, repeat) and one bad client cycling through "
        f"{', '.join(result['bad_kinds'])}; samples every {cfg['sample_s']:g} s.", "",
        "| what | start | end | verdict |", "|---|---|---|---|",
        f"| server RSS (MiB, median of the first / last quarter after {v['warm_up_s']:g} s) | "
        f"{rss['start_mib']:.1f} | {rss['end_mib']:.1f} | {yes[rss['flat']]} "
        f"({rss['growth_mib']:+.1f} MiB, allowed ±{rss['allowed_mib']:.0f}; slope "
        f"{'n/a' if slope is None else f'{slope:+.1f} MiB/h'}; max {rss['max_mib']:.1f}) |",
        f"| open fds (idle before / after) | {fds['idle_start']} | {fds['idle_end']} | "
        f"{yes[fds['flat']]} (allowed +{fds['allowed_growth']}; max under load "
        f"{fds['max_under_load']}) |",
        f"| KV blocks used (idle at the end) | - | {blocks['used_when_idle_at_end']:g} | "
        f"{yes[blocks['flat']]} (max under load {blocks['max_used_under_load']:g}) |",
        f"| threads (idle before / after) | {v['threads']['idle_start']} | "
        f"{v['threads']['idle_end']} | |", "",
        *(f"![RSS, fds and blocks over the run]({name})" for name in result["plots"]), "",
        "Sessions by client kind and outcome: " + ", ".join(
            f"{k} {n}" for k, n in sorted(c["sessions"].items())) + ".", "",
        "Frames by status (as clients saw them): " + ", ".join(
            f"{k} {n}" for k, n in sorted(c["frames"].items())) + "; error events: " + ", ".join(
            f"{k} {n}" for k, n in sorted(c["errors"].items())) + ".", "",
        "Raw samples and the verdict: the JSON beside this file.", "",
    ]
    return "\n".join(lines)
