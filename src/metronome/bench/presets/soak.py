"""`metronome bench soak`: does the server stay flat over a long run of churning sessions?

`metronome serve` in a subprocess (one torch thread: this measures flatness, not latency);
a few good clients churn for `duration_s` (open, stream speech at real-time pace for a few
seconds, close, repeat) beside one bad client (it vanishes mid-stream, sends malformed and
oversized events, floods audio without reading, says nothing). Every `sample_s`: the server
process's resident memory, open fds and threads, and the KV pool's used blocks; once the
clients stop and the server is idle, again. Flat: RSS from the first to the last quarter of
the run (after a warm-up) within max(16 MiB, 2 %), idle fds back where they started (+2),
no KV block held once every session has closed. Derived number: that RSS growth, in MiB.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass

from metronome.bench.presets import knob
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "soak"
RATE_HZ, CHUNK_S = 24000, 0.1
BAD_KINDS = ("abrupt", "garbage", "oversized_text", "no_read", "silent")


@dataclass(frozen=True)
class Config:
    duration_s: float = knob(1800.0, "how long clients churn")
    sessions: int = knob(3, "good clients at once (plus one bad client)")
    model: str = knob("bundled", "'bundled', a HF directory, or preset:NAME[:L]")
    pool_tokens: int = knob(8192, "the server's KV pool in tokens")
    sample_s: float = knob(5.0, "seconds between samples")
    session_s: tuple[float, float] = knob((3.0, 10.0), "each good session streams this long")
    idle_timeout_s: float = knob(5.0, "the server's idle timeout (closes the silent client)")

    def __post_init__(self) -> None:
        if self.duration_s < 1.0 or self.sessions < 1 or self.sample_s < 0.1 or not (
                0 < self.session_s[0] <= self.session_s[1]):
            raise ValueError(f"need duration_s >= 1, sessions >= 1, sample_s >= 0.1 and "
                             f"0 < session_s[0] <= session_s[1]: {self}")

    @classmethod
    def smoke(cls) -> Config:
        return cls(duration_s=6.0, sessions=2, sample_s=1.0)


class Clients:
    """The good clients and the bad one, and what they saw."""

    def __init__(self, url: str, rng: random.Random, cfg: Config) -> None:
        from metronome.load.speech import SPEECH_DIR, speech_stream

        self.url, self.rng, self.cfg = url, rng, cfg
        self.speech = speech_stream(SPEECH_DIR, RATE_HZ, 30.0)
        self.outcomes, self.frames, self.errors = Counter(), Counter(), Counter()

    def chunks(self, seconds: float) -> list[bytes]:
        size = int(RATE_HZ * CHUNK_S) * 2
        start = self.rng.randrange(0, len(self.speech) // size - int(seconds / CHUNK_S)) * size
        return [self.speech[start + k * size: start + (k + 1) * size]
                for k in range(int(seconds / CHUNK_S))]

    async def read(self, conn, seconds: float | None = None) -> None:
        async def counting():
            async for event in conn:
                if event["type"] == "metronome.frame":
                    self.frames[event["frame"]["status"]] += 1
                elif event["type"] == "error":
                    self.errors[event["error"]["code"]] += 1
        try:
            await asyncio.wait_for(counting(), seconds)
        except TimeoutError:
            return

    async def loop(self, kind: str | None, stop_at: float) -> None:
        """One client's sessions until `stop_at`: good ones (`kind` None) or the bad kinds."""
        from websockets.exceptions import ConnectionClosed, InvalidStatus

        turn = 0
        while time.monotonic() < stop_at:
            bad = BAD_KINDS[turn % len(BAD_KINDS)]
            turn += 1
            try:
                outcome = await (self.good() if kind else self.bad(bad))
            except InvalidStatus as err:
                outcome = f"refused_{err.response.status_code}"
            except (ConnectionClosed, OSError, TimeoutError) as err:
                outcome = type(err).__name__
            self.outcomes[f"{kind or 'bad_' + bad}:{outcome}"] += 1
            await asyncio.sleep(self.rng.uniform(0.1, 1.0))

    async def good(self) -> str:
        from metronome.load.client import Connection

        conn = await Connection.open(self.url)
        reader = asyncio.create_task(self.read(conn))
        try:
            begin = time.monotonic()
            for k, chunk in enumerate(self.chunks(self.rng.uniform(*self.cfg.session_s))):
                await conn.append(chunk)
                await asyncio.sleep(max(0.0, begin + (k + 1) * CHUNK_S - time.monotonic()))
            await asyncio.sleep(1.5)  # the last frames' answers
            return "completed"
        finally:
            reader.cancel()
            await conn.close()

    async def bad(self, kind: str) -> str:
        from metronome.load.client import Connection

        conn = await Connection.open(self.url)
        try:
            if kind in ("abrupt", "no_read"):  # vanish mid-stream; flood, never read
                for chunk in self.chunks(1.5 if kind == "abrupt" else 6.0):
                    await conn.append(chunk)
                    await asyncio.sleep(CHUNK_S if kind == "abrupt" else 0)
                await asyncio.sleep(0 if kind == "abrupt" else 2.0)
                return "aborted"
            if kind == "silent":  # until the server's idle timeout closes it
                await self.read(conn, 15.0)
                return "closed_by_server"
            for message in (["{not json", {"type": "nope"}, b"\x00\x01",
                             {"type": "session.update", "session": {"x": 1}}]
                            if kind == "garbage" else [  # over the input bound and size cap
                                {"type": "conversation.item.create", "item": {
                                    "type": "message", "role": "user", "content": [{
                                        "type": "input_text", "text": "é世😀 " * 2000}]}},
                                {"type": "input_audio_buffer.append", "audio": "A" * (2 << 20)}]):
                await conn.send(message)
            await self.read(conn, 1.0)
            await conn.close()
            return "completed"
        finally:
            await conn.drop()


async def _sample(process, http, t_s: float, phase: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    metrics = {(s.name, s.labels.get("state", "")): s.value for family in
               text_string_to_metric_families((await http.get("/metrics")).text)
               for s in family.samples}
    return {"t_s": round(t_s, 2), "phase": phase, "rss_mib": process.memory_info().rss / 2**20,
            "open_fds": process.num_fds(), "threads": process.num_threads(),
            "used_blocks": metrics.get(("metronome_kv_pool_blocks", "used")),
            "sessions": metrics.get(("metronome_sessions_active", ""))}


async def _soak(cfg: Config, seed: int, server) -> dict:
    import httpx
    import psutil

    process, clients = psutil.Process(server.process.pid), Clients(server.ws_url,
                                                                   random.Random(seed), cfg)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        samples = [await _sample(process, http, -1.0, "idle_start") for _ in range(3)]
        started = time.monotonic()
        stop_at = started + cfg.duration_s
        loops = [asyncio.create_task(clients.loop("good", stop_at)) for _ in range(cfg.sessions)]
        loops.append(asyncio.create_task(clients.loop(None, stop_at)))
        while time.monotonic() < stop_at:
            await asyncio.sleep(min(cfg.sample_s, max(0.0, stop_at - time.monotonic())))
            samples.append(await _sample(process, http, time.monotonic() - started, "load"))
        await asyncio.gather(*loops)
        for _ in range(60):  # idle: every client gone (the silent one by the idle timeout)
            health = (await http.get("/healthz")).json()
            if health["sessions"] == 0 and health["kv_pool"]["used_blocks"] == 0:
                break
            await asyncio.sleep(0.5)
        samples += [await _sample(process, http, time.monotonic() - started, "idle_end")
                    for _ in range(3)]
    return {"samples": samples, "clients": [{"what": f"{kind} {key}", "count": n}
                                            for kind, counts in (("sessions", clients.outcomes),
                                                                 ("frames", clients.frames),
                                                                 ("errors", clients.errors))
                                            for key, n in sorted(counts.items())]}


def verdict(samples: list[dict], duration_s: float) -> list[dict]:
    """Flat or not, for RSS, fds and blocks, with the numbers behind each."""
    load = [s for s in samples if s["phase"] == "load"]
    steady = [s for s in load if s["t_s"] >= min(60.0, 0.1 * duration_s)] or load
    quarter = max(1, len(steady) // 4)
    rss = [statistics.median(s["rss_mib"] for s in part)
           for part in (steady[:quarter], steady[-quarter:])]
    idle = [[s for s in samples if s["phase"] == p][-1] for p in ("idle_start", "idle_end")]
    return [{"what": "server RSS MiB (median, first / last quarter)", "start": rss[0],
             "end": rss[1], "allowed": max(16.0, 0.02 * rss[0]),
             "flat": abs(rss[1] - rss[0]) <= max(16.0, 0.02 * rss[0])},
            {"what": "open fds (idle before / after)", "start": idle[0]["open_fds"],
             "end": idle[1]["open_fds"], "allowed": 2,
             "flat": idle[1]["open_fds"] <= idle[0]["open_fds"] + 2},
            {"what": "KV blocks used (idle before / after)", "start": idle[0]["used_blocks"],
             "end": idle[1]["used_blocks"], "allowed": 0, "flat": idle[1]["used_blocks"] == 0},
            {"what": "threads (idle before / after)", "start": idle[0]["threads"],
             "end": idle[1]["threads"], "allowed": None, "flat": None}]


def run(ctx: RunContext, cfg: Config) -> dict:
    import os

    from metronome.bench.server import Server, served_facts

    ctx.record(**served_facts(cfg.model), nice=os.nice(0))
    with Server.start(["--model", cfg.model, "--pool-tokens", str(cfg.pool_tokens),
                       "--admission", "off", "--idle-timeout-s", f"{cfg.idle_timeout_s:g}",
                       "--log-level", "warning"], timeout_s=300.0) as server:
        result = asyncio.run(_soak(cfg, ctx.seed, server))
    flat = verdict(result["samples"], cfg.duration_s)
    return REPORT.finish(ctx, result | {
        "config": asdict(cfg), "server": [{"command": server.command}], "verdict": flat,
        "derived": derived("server RSS growth, first to last quarter of the run (MiB)",
                           flat[0]["end"] - flat[0]["start"])})


REPORT = Report("Soak: does `metronome serve` stay flat under churning sessions?", spec="+.1f",
                tables=(Table("Verdict", "verdict", (
                    ("what", "what", ""), ("start", "start", ".1f"), ("end", "end", ".1f"),
                    ("allowed growth", "allowed", ".0f"), ("flat", "flat", ""))),
                        Table("The server", "server"), Table("What the clients saw", "clients")),
                plots=(Plot("{stem}.png", "samples", x="t_s",
                            ys=("rss_mib", "open_fds", "used_blocks")),))
report = REPORT.markdown
