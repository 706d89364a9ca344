"""`metronome bench endless`: does one session of real-time frames run flat for hours? One
session streams Hamlet at one frame a period (`tokens_in` in, `tokens_out` out per frame,
each due a period after it arrives) for `duration_s` on the wall clock; each arm in a fresh
process, the same frames for both:

- `native`: Metronome's engine on the beat, as `metronome serve` runs it, under the server's
  default bound (sinks + window, absolute positions until the model's position limit, then
  rolling: `Engine._keep_in_range`);
- `vllm_sliding_window`: vLLM's own sliding window of S + W tokens on every layer (the same
  resident KV), a frame's input and output as the next step of one request in arrival
  order (vLLM's streaming input), `max_model_len` as vLLM users set it; it runs until vLLM
  stops the request or `vllm_duration_s` (when vLLM is importable: run the bench from
  .venv-vllm; else the arm is skipped and the report says so).

Per bucket of session age (`bucket_s`): frames, on time, latency p50 / p99; every `sample_s`:
the process's RSS, the KV blocks in use and the session's length in tokens. Derived number:
the native arm's p99 latency in its last bucket over its first (1.0: flat).
"""

from __future__ import annotations

import importlib.util
import threading
import time
from dataclasses import asdict, dataclass

import psutil

from metronome.bench import systems as sy
from metronome.bench.engine.facts import BUNDLED_MODEL
from metronome.bench.presets import Knobs, knob
from metronome.bench.workload import in_fresh_process, run_workload
from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.types import WorkStatus
from metronome.kv.residency import Positions, ResidencyPolicy
from metronome.model.weights import load_tokenizer
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived
from metronome.runtime.cores import reserve_for_engine_thread
from metronome.runtime.profile import SessionProfile
from metronome.sim.local import text_source
from metronome.sim.workload import Workload
from metronome.stats import percentile
from metronome.stream import Stream
from metronome.workload_defaults import POLICY_SPEC

NAME = "endless"
ARMS = ("native", "vllm_sliding_window")


@dataclass(frozen=True)
class Config(Knobs):
    arms: tuple[str, ...] = knob(ARMS, f"arms, of {', '.join(ARMS)}")
    duration_s: float = knob(7200.0, "how long the session streams (native arm)")
    vllm_mode: str = knob("default", "how vLLM runs: default (compiled) or eager")
    vllm_duration_s: float = knob(900.0, "the vLLM arm's longest run (it stops at "
                                  "max_model_len well before)")
    period_s: float = knob(1.0, "frame period, and each frame's deadline")
    tokens_in: int = knob(16, "input tokens per frame")
    tokens_out: int = knob(4, "output tokens per frame")
    policy: str = knob(POLICY_SPEC, "the bound (the server's default); vLLM's window is S + W")
    pool_tokens: int = knob(16384, "the KV pool in tokens (both arms)")
    max_model_len: int = knob(8192, "vLLM's max_model_len (the bundled model's trained "
                              "positions)")
    position_limit_tokens: int = knob(0, "the native engine's position limit (0: the model's "
                                      "own, 8192 for the bundled SmolLM2)")
    bucket_s: float = knob(600.0, "buckets of session age for the latency table")
    sample_s: float = knob(10.0, "seconds between RSS / KV samples")

    SMOKE = dict(arms=("native",), duration_s=8.0, vllm_duration_s=8.0, bucket_s=4.0,
                 sample_s=1.0, pool_tokens=4096, policy="sinks_window:4:32",
                 position_limit_tokens=64)

    def __post_init__(self) -> None:
        if set(self.arms) - set(ARMS):
            raise ValueError(f"unknown arms {sorted(set(self.arms) - set(ARMS))}; known: "
                             f"{', '.join(ARMS)}")


class Sampler:
    """Every `every_s`, on its own thread: RSS, blocks in use, the session's tokens."""

    def __init__(self, read, every_s: float) -> None:
        self.read, self.every_s, self.rows = read, every_s, []
        self.started = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._process = psutil.Process()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        self.rows.append({"t_s": round(time.perf_counter() - self.started, 1),
                          "rss_mib": self._process.memory_info().rss / 2**20} | self.read())

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.rows


def native_arm(cfg: Config) -> dict:
    reserve_for_engine_thread()  # as `metronome serve` does, before the model loads
    model = sy.load_model()
    engine = Engine(model, EngineConfig(pool_tokens=cfg.pool_tokens, position_limit_tokens=(
        cfg.position_limit_tokens or None)))
    engine.warm_up()
    rolled_at: list[float] = []

    def read() -> dict:
        session = next(iter(engine.sessions.values()), None)
        tokens = 0 if session is None else session.table.num_tokens
        if session is not None and not rolled_at and (
                session.spec.policy.positions is Positions.ROLLING):
            rolled_at.append(sampler.rows[-1]["t_s"] if sampler.rows else 0.0)
        return {"used_blocks": engine.pool.num_used_blocks, "session_tokens": tokens}

    sampler = Sampler(read, cfg.sample_s)
    run = run_workload(
        engine, Workload(1, cfg.duration_s),
        SessionProfile(frame_period_s=cfg.period_s, max_output_tokens_per_frame=cfg.tokens_out,
                       policy=ResidencyPolicy.parse(cfg.policy)),
        text_source(load_tokenizer(), model.config.vocab_size, cfg.tokens_in),
        log=lambda line: print(f"  native: {line}", flush=True))
    samples = sampler.stop()
    frames = [{"age_s": f.arrival_s, "latency_ms": None if f.status is None else
               f.latency_s * 1e3, "on_time": bool(f.good), "status": str(f.status)}
              for f in run.frames if f.arrival_s + run.deadline_s <= run.stopped_s]
    return {"arm": "native", "frames": frames, "samples": samples, "stopped": {
        "how": "ran to the end", "at_s": round(run.stopped_s, 1),
        "session_tokens": max(s["session_tokens"] for s in samples),
        "rolled_at_s": rolled_at[0] if rolled_at else None,
        "position_limit_tokens": engine.position_limit_tokens}}


def vllm_arm(cfg: Config) -> dict:
    """One vLLM request fed frame by frame in arrival order (each frame's input, then its
    output tokens, as the next step of the same request), until vLLM stops it."""
    bound = ResidencyPolicy.parse(cfg.policy)
    engine = sy.vllm_engine("vllm_sliding_window", bound, cfg.pool_tokens, cfg.max_model_len,
                            1, mode=cfg.vllm_mode)
    engine.warm_up()
    source = text_source(load_tokenizer(), engine.vocab_size, cfg.tokens_in)
    stream = Stream("s0", spec=SessionProfile(max_output_tokens_per_frame=cfg.tokens_out,
                                              policy=ResidencyPolicy.unbounded()).spec)
    sid = engine.open_session(stream)
    written = [0]
    sampler = Sampler(lambda: {"used_blocks": engine.pool_stats().used_blocks,
                               "session_tokens": written[0]}, cfg.sample_s)
    frames, stopped, started = [], None, time.perf_counter()
    index = 0
    while stopped is None:
        due_s = (index + 1) * cfg.period_s
        if due_s > cfg.vllm_duration_s:
            stopped = {"how": "ran to vllm_duration_s", "at_s": round(due_s, 1)}
            break
        time.sleep(max(0.0, due_s - (time.perf_counter() - started)))
        engine.submit(sid, source(0, index)[0], max_new_tokens=cfg.tokens_out)
        status = None
        while status is None:  # the frame's input, then its output tokens
            out = engine.step()
            written[0] += out.input_tokens.get(sid, 0)
            if out.status.get(sid) is WorkStatus.CONTEXT_FULL:
                status = "context_full"
            elif not engine.has_work:
                status = "ok"
        latency_ms = (time.perf_counter() - started - due_s) * 1e3
        frames.append({"age_s": due_s, "latency_ms": latency_ms if status == "ok" else None,
                       "on_time": status == "ok" and latency_ms <= cfg.period_s * 1e3,
                       "status": status})
        if status == "context_full":
            stopped = {"how": "vLLM ended the request at max_model_len (context_full): the "
                       "session's next frame is refused", "at_s": round(due_s, 1)}
        index += 1
        if index % 60 == 0:
            print(f"  vllm: t={due_s:.0f} s, {written[0]} tokens", flush=True)
    samples = sampler.stop()
    engine.shutdown()
    return {"arm": "vllm_sliding_window", "frames": frames, "samples": samples,
            "stopped": stopped | {"session_tokens": written[0],
                                  "max_model_len": cfg.max_model_len}}


def buckets(arm: dict, bucket_s: float, period_s: float) -> list[dict]:
    """Per `bucket_s` of session age: frames, on time, latency, and the samples' largest
    blocks, RSS and length. A last bucket with less than half a bucket of frames (the run's
    final frame or two) is left out: its percentiles would stand for nothing."""
    rows = []
    frames = arm["frames"]
    if not frames:
        return rows
    last = max(f["age_s"] for f in frames)
    k = 0
    while k * bucket_s < last:
        mine = [f for f in frames if k * bucket_s < f["age_s"] <= (k + 1) * bucket_s]
        lat = sorted(f["latency_ms"] for f in mine if f["latency_ms"] is not None)
        samples = [s for s in arm["samples"] if k * bucket_s < s["t_s"] <= (k + 1) * bucket_s]
        k += 1
        if k > 1 and len(mine) < bucket_s / period_s / 2 and k * bucket_s >= last:
            break
        rows.append({"arm": arm["arm"], "age_to_s": round(k * bucket_s),
                     "frames": len(mine), "answered": len(lat),
                     "on_time": sum(f["on_time"] for f in mine) / len(mine) if mine else None,
                     "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                     "max_blocks": max((s["used_blocks"] for s in samples), default=None),
                     "max_rss_mib": max((s["rss_mib"] for s in samples), default=None),
                     "session_tokens": max((s["session_tokens"] for s in samples),
                                           default=None)})
    return rows


def summarize(arms: list[dict], cfg: Config, skipped: list[dict]) -> dict:
    """The result from the arms' frames, samples and ends (`rewrite` makes it again from a
    result's JSON)."""
    table = [row for arm in arms for row in buckets(arm, cfg.bucket_s, cfg.period_s)]
    native = [row for row in table if row["arm"] == "native" and row["p99_ms"]]
    ratio = native[-1]["p99_ms"] / native[0]["p99_ms"] if len(native) >= 2 else None
    return {
        "config": asdict(cfg), "buckets": table, "skipped": skipped,
        "stopped": [{"arm": a["arm"]} | a["stopped"] for a in arms],
        "samples": [{"arm": a["arm"]} | s for a in arms for s in a["samples"]],
        "arms": [{"arm": a["arm"], "frames": a["frames"]} for a in arms],
        "derived": derived("native p99 latency, last age bucket over first (1.0: flat)", ratio)}


def run(ctx: RunContext, cfg: Config) -> dict:
    has_vllm = importlib.util.find_spec("vllm") is not None
    ctx.record(model=BUNDLED_MODEL, dtype=sy.DTYPE,
               vllm_mode=f"{cfg.vllm_mode}, in-process" if has_vllm else None)
    arms, skipped = [], []
    for arm in cfg.arms:
        if arm == "vllm_sliding_window" and not has_vllm:
            skipped.append({"arm": arm, "why": "vLLM is not importable here (run the bench "
                            "from .venv-vllm: `make vllm-install`)"})
            continue
        ctx.log(f"endless: {arm}")
        arms.append(in_fresh_process(native_arm if arm == "native" else vllm_arm, cfg))
        ctx.keep("arms", arms)
    return REPORT.finish(ctx, summarize(arms, cfg, skipped))


def rewrite(path: str) -> None:
    """Summarize a written result's JSON again, with this module's `summarize`, and write its
    JSON and report in place (its run, provenance, command and figure unchanged; `rewritten`
    says when). For a fix in how a run is summarized, not in what it measured."""
    import json
    import subprocess
    from pathlib import Path

    out = Path(path)
    old = json.loads(out.read_text())
    cfg = Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in old["config"].items()})
    arms = [{"arm": a["arm"], "frames": a["frames"],
             "samples": [{k: v for k, v in s.items() if k != "arm"} for s in old["samples"]
                         if s["arm"] == a["arm"]],
             "stopped": {k: v for k, v in next(s for s in old["stopped"]
                                                if s["arm"] == a["arm"]).items() if k != "arm"}}
            for a in old["arms"]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    new = old | summarize(arms, cfg, old.get("skipped", [])) | {
        "rewritten": f"summarized again at {commit} (a last bucket of one frame left out)"}
    out.write_text(json.dumps(new, indent=2))
    out.with_suffix(".md").write_text(REPORT.markdown(new) + f"\n{new['rewritten']}.\n")


REPORT = Report("Endless: one real-time session for hours, Metronome against vLLM's sliding "
                "window", spec=".2f", tables=(
                    Table("How each arm ended", "stopped", (
                        ("arm", "arm", ""), ("how", "how", ""), ("at s", "at_s", ".0f"),
                        ("session tokens", "session_tokens", ""),
                        ("rolled at s (position limit)", "rolled_at_s", ".0f"),
                        ("position limit", "position_limit_tokens", ""),
                        ("max_model_len", "max_model_len", ""))),
                    Table("By session age (latency of answered frames; blocks, RSS and "
                          "tokens: the most sampled in the bucket)", "buckets"),
                    Table("Arms not run", "skipped")),
                plots=(Plot("{stem}.png", "samples", x="t_s",
                            ys=("rss_mib", "used_blocks", "session_tokens"), series="arm"),))
report = REPORT.markdown
