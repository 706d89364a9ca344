"""`bench cluster`'s autoscaling run, measured on a running `--replicas MIN..MAX` cluster:
offered sessions stepping up and down, each refused session retrying as its Retry-After
says until admitted or its time is over (a user who keeps trying), the cluster sampled
every `sample_period_s` from `GET /v1/cluster` (replicas serving and draining, the
autoscaler's desired count and headroom, caps, sessions).

`schedule` turns the offered levels into session spans; `run` drives them and returns the
raw record (sessions, frames, samples, the autoscaler's decisions); `timeline` and
`summary` derive what the report shows. `metronome.bench.cluster_bench` holds the config,
the report and the figure.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from metronome.load.client import ClientSettings, FrameRecord, SessionClient
from metronome.load.run import LoadConfig
from metronome.load.speech import SPEECH_DIR, speech_stream

MIN_SESSION_S = 3.0  # a user whose span has less left than this stops retrying


def schedule(levels: tuple[int, ...], step_s: float) -> list[tuple[float, float]]:
    """Each session's (start_s, end_s) for offered concurrency `levels`, one per step: a
    step up starts sessions at its start, a step down ends the newest ones there."""
    open_s: list[float] = []
    spans: list[tuple[float, float]] = []
    for k, level in enumerate(levels):
        while len(open_s) > level:
            spans.append((open_s.pop(), k * step_s))
        open_s += [k * step_s] * (level - len(open_s))
    spans += [(start_s, len(levels) * step_s) for start_s in open_s]
    return sorted(spans)


async def _user(settings: ClientSettings, index: int, span: tuple[float, float], pcm: bytes,
                origin_s: float, frames: list[FrameRecord]) -> dict:
    start_s, end_s = span
    record = {"session": index, "start_s": start_s, "end_s": end_s, "refused_at_s": [],
              "admitted_at_s": None, "outcome": "gave_up", "frames": 0, "close_code": None}
    await asyncio.sleep(max(0.0, origin_s + start_s - time.monotonic()))
    while (left_s := end_s - (time.monotonic() - origin_s)) >= MIN_SESSION_S:
        keep = round(left_s * settings.sample_rate_hz) * 2
        client = SessionClient(settings, index, pcm[:keep], origin_s, frames.append)
        tried_s = time.monotonic() - origin_s
        outcome = await client.run()
        if outcome.outcome == "refused":
            record["refused_at_s"].append(tried_s)
            await asyncio.sleep(outcome.retry_after_s or 2.0)
            continue
        record |= {"admitted_at_s": tried_s, "outcome": outcome.outcome,
                   "frames": outcome.frames, "close_code": outcome.close_code}
        break
    return record


async def _sample(url: str, origin_s: float, period_s: float, done: asyncio.Event,
                  samples: list[dict]) -> dict:
    """Sample the cluster view until `done`; returns the last view."""
    last: dict = {}
    async with httpx.AsyncClient(timeout=5) as http:
        while not done.is_set():
            at_s = time.monotonic() - origin_s
            try:
                last = (await http.get(url + "/v1/cluster")).json()
            except (httpx.HTTPError, ValueError):
                await asyncio.sleep(period_s)
                continue
            live = [r for r in last["replicas"] if r["status"] != "unreachable"]
            serving = [r for r in live if not r["draining"]]
            auto = last.get("autoscaling") or {}
            samples.append({
                "t_s": round(at_s, 2), "replicas_serving": len(serving),
                "replicas_draining": len(live) - len(serving),
                "desired_replicas": auto.get("desired_replicas"),
                "headroom": auto.get("headroom"), "cap": sum(r["cap"] for r in serving),
                "active_sessions": sum(r["active_sessions"] for r in live)})
            await asyncio.sleep(period_s)
    return last


async def _drive(url: str, ws_url: str, levels: tuple[int, ...], step_s: float,
                 sample_period_s: float) -> dict:
    load = LoadConfig()
    settings = ClientSettings(ws_url, load.mode, load.sample_rate_hz, load.chunk_ms, None)
    frames: list[FrameRecord] = []
    samples: list[dict] = []
    done = asyncio.Event()
    spans = schedule(levels, step_s)
    speech = [speech_stream(SPEECH_DIR, settings.sample_rate_hz, end_s - start_s, offset=i)
              for i, (start_s, end_s) in enumerate(spans)]  # before the clock starts
    origin_s, origin_wall_s = time.monotonic(), time.time()
    sampler = asyncio.create_task(_sample(url, origin_s, sample_period_s, done, samples))
    users = await asyncio.gather(*(_user(settings, i, span, pcm, origin_s, frames)
                                   for i, (span, pcm) in enumerate(zip(spans, speech,
                                                                       strict=True))))
    await asyncio.sleep(2 * step_s)  # after the load: the last scale-downs
    done.set()
    last = await sampler
    events = [{**e, "t_s": round(e["at_s"] - origin_wall_s, 2)}
              for e in (last.get("autoscaling") or {}).get("events", [])]
    return {"sessions": users, "samples": samples, "events": events,
            "frames": [{"t_s": round(f.received_at_s, 2), "good": f.good} for f in frames]}


def run(url: str, levels: tuple[int, ...], step_s: float, sample_period_s: float) -> dict:
    """The raw record of one autoscaling run against the cluster at `url`."""
    ws_url = url.replace("http", "ws") + "/v1/realtime"
    return asyncio.run(_drive(url, ws_url, levels, step_s, sample_period_s))


def timeline(raw: dict, levels: tuple[int, ...], step_s: float) -> list[dict]:
    """Per step: offered sessions, replicas serving (min..max seen), the headroom seen
    (min), refusals, admissions, frames and misses (server's verdict) in that step."""
    rows = []
    for k, offered in enumerate(levels):
        lo, hi = k * step_s, (k + 1) * step_s
        seen = [s for s in raw["samples"] if lo <= s["t_s"] < hi]
        frames = [f for f in raw["frames"] if lo <= f["t_s"] < hi]
        headrooms = [s["headroom"] for s in seen if s["headroom"] is not None]
        rows.append({
            "step": k, "from_s": lo, "offered": offered,
            "replicas_min": min((s["replicas_serving"] for s in seen), default=None),
            "replicas_max": max((s["replicas_serving"] for s in seen), default=None),
            "headroom_min": min(headrooms, default=None),
            "refusals": sum(lo <= t < hi for u in raw["sessions"] for t in u["refused_at_s"]),
            "frames": len(frames), "misses": sum(not f["good"] for f in frames)})
    return rows


def binned(raw: dict, width_s: float) -> list[dict]:
    """Refusals, frames and misses per `width_s` from the load's start."""
    end_s = max([f["t_s"] for f in raw["frames"]] + [s["t_s"] for s in raw["samples"]],
                default=0.0)
    rows = [{"t_s": k * width_s, "refusals": 0, "frames": 0, "misses": 0}
            for k in range(int(end_s // width_s) + 1)]
    for u in raw["sessions"]:
        for t_s in u["refused_at_s"]:
            rows[min(int(t_s // width_s), len(rows) - 1)]["refusals"] += 1
    for f in raw["frames"]:
        row = rows[min(int(f["t_s"] // width_s), len(rows) - 1)]
        row["frames"] += 1
        row["misses"] += not f["good"]
    return rows


def summary(raw: dict) -> dict:
    """Whole-run numbers: sessions by outcome, refusals, waits, misses, decisions and how
    long each took to take effect (an added replica serving; a removed one gone)."""
    users = raw["sessions"]
    waits = [u["admitted_at_s"] - u["start_s"] for u in users if u["admitted_at_s"] is not None]
    frames = raw["frames"]
    return {
        "sessions": len(users),
        "admitted": sum(u["admitted_at_s"] is not None for u in users),
        "gave_up": sum(u["outcome"] == "gave_up" for u in users),
        "closed_by_server": sum(u["outcome"] == "closed_by_server" for u in users),
        "refusals": sum(len(u["refused_at_s"]) for u in users),
        "refused_sessions": sum(bool(u["refused_at_s"]) for u in users),
        "wait_s_max": max(waits, default=None),
        "frames": len(frames), "misses": sum(not f["good"] for f in frames),
        "decisions": [e | {"effect_s": _effect_s(e, raw["samples"])} for e in raw["events"]],
    }


def _effect_s(event: dict, samples: list[dict]) -> float | None:
    """Seconds from a decision to the serving replicas reaching its count (up) or the
    removed replica leaving the view, its drain done (down)."""
    for s in samples:
        if s["t_s"] < event["t_s"]:
            continue
        if (event["direction"] == "up" and s["replicas_serving"] >= event["to"]) or (
                event["direction"] == "down" and s["replicas_serving"] <= event["to"]
                and s["replicas_draining"] == 0):
            return round(s["t_s"] - event["t_s"], 1)
    return None
