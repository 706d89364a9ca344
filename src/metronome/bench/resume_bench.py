"""`metronome bench resume`: what it costs to keep a bounded session resumable (issue 24).

1. snapshot bytes per session: measured for the served model (a real session prefilled past
   its window, `Engine.snapshot_session(...).to_bytes()`), computed for `preset:moshi-7b`
   and `preset:qwen2.5-omni-7b` from their layer/head/dim shapes at the bound's steady block
   count in bf16 (no weights are loaded for them);
2. the step-time cost of snapshotting every session every K steps: N bounded sessions
   decoding, rounds of K steps without and with a snapshot of every session at the end,
   alternating in one run (min/median over rounds);
3. restore latency into another engine: the snapshot's bytes loaded and opened in a second
   engine over the same model (the engine side of resuming on another replica);
4. resume latency through real servers, on the same server and on another one through the
   checkpoint store (`bench.resume_servers`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from metronome.bench.resume_servers import (
    STORES,
    measure_other_server,
    measure_same_server,
    ms_stats,
)
from metronome.engine.engine import Engine, EngineConfig, blocks_per_session
from metronome.engine.session import SessionSpec
from metronome.engine.snapshot import SessionSnapshot
from metronome.kv.residency import ResidencyPolicy
from metronome.model.config import PRESETS
from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.results.tables import fmt, md_table
from metronome.workload_defaults import BLOCK_SIZE_TOKENS, POLICY_SPEC

NAME = "resume"
PRESET_MODELS = ("moshi-7b", "qwen2.5-omni-7b")
PRESET_DTYPE = torch.bfloat16  # the presets' serving dtype (the paper's setting)


@dataclass(frozen=True)
class Config:
    dtype: str = field(default="auto", metadata={"help": "the bundled model's dtype"})
    policy: str = field(default=POLICY_SPEC, metadata={"help": "every session's bound"})
    snapshots: int = field(default=40, metadata={
        "help": "snapshot/serialize/load/restore cycles timed on one session"})
    sessions: int = field(default=16, metadata={"help": "sessions decoding in the step-cost "
                                                        "part"})
    interval_steps: int = field(default=16, metadata={
        "help": "K: every session is snapshotted once every K steps"})
    rounds: int = field(default=12, metadata={"help": "rounds of K steps, each with and "
                                                     "without snapshots"})
    resumes: int = field(default=40, metadata={"help": "resumes timed, on the same server "
                                                      "and on the other one"})
    store: str = field(default="ray", metadata={
        "help": "the store the other-server resumes go through: ray (the cluster's session "
                "store actor, on a local Ray) or memory"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(policy="sinks_window:4:64", snapshots=3, sessions=2, interval_steps=4,
                   rounds=2, resumes=3, store="memory")


def _steady_bytes(cfg, dtype: torch.dtype, policy: ResidencyPolicy) -> dict:
    blocks = policy.max_blocks(BLOCK_SIZE_TOKENS)
    per_token = cfg.kv_bytes_per_token(dtype)
    return {"kv_bytes_per_token": per_token, "blocks": blocks,
            "resident_tokens": blocks * BLOCK_SIZE_TOKENS,
            "bytes_at_s_plus_w": (policy.sink_tokens + policy.window_tokens) * per_token,
            "bytes": blocks * BLOCK_SIZE_TOKENS * per_token}


def computed_sizes(model, policy: ResidencyPolicy) -> list[dict]:
    rows = []
    for name, cfg, dtype in (("bundled", model.config, model.dtype),
                             *((f"preset:{n}", PRESETS[n], PRESET_DTYPE) for n in PRESET_MODELS)):
        rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."),
                     "layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads,
                     "head_dim": cfg.head_dim, **_steady_bytes(cfg, dtype, policy)})
    return rows


def _engine(model, policy: ResidencyPolicy, sessions: int) -> Engine:
    config = EngineConfig(block_size=BLOCK_SIZE_TOKENS)
    blocks = blocks_per_session(policy, config) * sessions + 4
    return Engine(model, EngineConfig(block_size=BLOCK_SIZE_TOKENS,
                                      pool_tokens=blocks * BLOCK_SIZE_TOKENS))


def measure_snapshot_cycle(model, policy: ResidencyPolicy, repeats: int) -> dict:
    """One session prefilled past its window; `repeats` times: take, to_bytes, from_bytes,
    restore into a second engine (then closed there), each timed."""
    source, target = _engine(model, policy, 1), _engine(model, policy, 1)
    sid = source.open_session(SessionSpec(policy=policy, stop_token_ids=()))
    prompt = policy.sink_tokens + policy.window_tokens + 2 * BLOCK_SIZE_TOKENS
    source.submit(sid, [(7 * i + 11) % 1000 + 100 for i in range(prompt)], max_new_tokens=1)
    while source.has_work:
        source.step()
    stages = {"take": [], "to_bytes": [], "from_bytes": [], "restore": []}
    nbytes = kv_bytes = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        snapshot = source.snapshot_session(sid)
        t1 = time.perf_counter()
        data = snapshot.to_bytes()
        t2 = time.perf_counter()
        loaded = SessionSnapshot.from_bytes(data)
        t3 = time.perf_counter()
        restored = target.restore_session(loaded)
        t4 = time.perf_counter()
        assert restored is not None, "the target pool holds one session"
        target.close(restored)
        for stage, seconds in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            stages[stage].append(seconds)
        nbytes, kv_bytes = len(data), snapshot.kv_bytes
    return {"session_tokens": source.session_tokens(sid), "blocks": source.session_blocks(sid),
            "bytes": nbytes, "kv_bytes": kv_bytes,
            "stages": {stage: ms_stats(seconds) for stage, seconds in stages.items()}}


def measure_step_cost(model, policy: ResidencyPolicy, sessions: int, interval: int,
                      rounds: int) -> dict:
    """`sessions` bounded sessions decoding (their windows full, by `fast_forward`); rounds
    of `interval` steps, plain and with every session snapshotted after its last step,
    alternating which goes first."""
    engine = _engine(model, policy, sessions)
    sids = [engine.open_session(SessionSpec(policy=policy, stop_token_ids=()))
            for _ in range(sessions)]
    depth = policy.sink_tokens + policy.window_tokens + 2 * BLOCK_SIZE_TOKENS
    for sid in sids:
        assert engine.fast_forward(sid, depth)
        engine.submit(sid, [42], max_new_tokens=(2 * rounds + 1) * interval + 8)
    for _ in range(4):  # warm-up
        engine.step()
    plain, with_snap, take_s, serialize_s = [], [], [], []
    for r in range(rounds):
        for mode in (("plain", "snapshot") if r % 2 == 0 else ("snapshot", "plain")):
            started = time.perf_counter()
            for _ in range(interval):
                engine.step()
            if mode == "snapshot":
                t0 = time.perf_counter()
                snapshots = [engine.snapshot_session(sid) for sid in sids]
                t1 = time.perf_counter()
                for snapshot in snapshots:
                    snapshot.to_bytes()
                take_s.append(t1 - t0)
                serialize_s.append(time.perf_counter() - t1)
                with_snap.append((t1 - started) / interval)  # take only: the engine thread's
            else:
                plain.append((time.perf_counter() - started) / interval)
    plain_ms, snap_ms = ms_stats(plain), ms_stats(with_snap)
    paired = statistics.median(w / p - 1 for w, p in zip(with_snap, plain, strict=True))
    return {"sessions": sessions, "interval_steps": interval, "rounds": rounds,
            "step_plain": plain_ms, "step_with_snapshots": snap_ms,
            "overhead_median": snap_ms["median_ms"] / plain_ms["median_ms"] - 1,
            "overhead_min": snap_ms["min_ms"] / plain_ms["min_ms"] - 1,
            "overhead_paired_median": paired,  # each round against its own plain round
            "take_all": ms_stats(take_s), "to_bytes_all": ms_stats(serialize_s),
            "rows": {"plain_s": plain, "with_snapshots_s": with_snap}}


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.model.dtypes import resolve_dtype
    from metronome.model.weights import load_model

    if cfg.store not in STORES:
        raise ValueError(f"--store must be one of {', '.join(STORES)}, not {cfg.store!r}")
    dtype = resolve_dtype(cfg.dtype)
    policy = ResidencyPolicy.parse(cfg.policy)
    model = load_model("bundled", dtype)
    ctx.record(model="bundled (SmolLM2-135M-Instruct)", dtype=str(dtype).removeprefix("torch."))
    result = {"policy": str(policy), "block_size": BLOCK_SIZE_TOKENS,
              "dtype": str(dtype).removeprefix("torch.")}
    ctx.log("sizes and one session's snapshot cycle")
    result["computed"] = computed_sizes(model, policy)
    result["measured"] = measure_snapshot_cycle(model, policy, cfg.snapshots)
    ctx.keep("measured", result["measured"])
    ctx.log(f"step cost: {cfg.sessions} sessions, a snapshot of each every "
            f"{cfg.interval_steps} steps")
    result["step_cost"] = measure_step_cost(model, policy, cfg.sessions, cfg.interval_steps,
                                            cfg.rounds)
    ctx.keep("step_cost", result["step_cost"])
    ctx.log(f"same-server resumes: {cfg.resumes}")
    result["server_resume"] = measure_same_server(model, cfg.resumes)
    ctx.keep("server_resume", result["server_resume"])
    ctx.log(f"other-server resumes through the {cfg.store} store: {cfg.resumes}")
    result["other_server_resume"] = measure_other_server(model, cfg.resumes, cfg.store)
    plot(ctx, result)
    return result


def plot(ctx: RunContext, r: dict) -> None:
    plt, save = ctx.figure("resume.png")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    rows = r["step_cost"]["rows"]
    left.plot([s * 1e3 for s in rows["plain_s"]], "o-", label="no snapshots")
    left.plot([s * 1e3 for s in rows["with_snapshots_s"]], "s-",
              label=f"every session every {r['step_cost']['interval_steps']} steps")
    left.set(xlabel="round", ylabel="ms per step (snapshot time spread over K steps)",
             title=f"{r['step_cost']['sessions']} sessions decoding")
    left.legend()
    for key, label in (("server_resume", "same server"),
                       ("other_server_resume", "other server (store)")):
        client = sorted(s * 1e3 for s in r[key]["client_s"])
        right.plot(client, [(i + 1) / len(client) for i in range(len(client))],
                   drawstyle="steps", label=label)
    right.set(xlabel="ms from connect to metronome.session.resumed", ylabel="share of resumes",
              title="resume latency (client side)", xscale="log")
    right.legend()
    save(fig)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.2f} MB"


def report(r: dict) -> str:
    m, s, sr = r["measured"], r["step_cost"], r["server_resume"]
    o = r["other_server_resume"]
    cp = o["checkpoints"]
    stages = m["stages"]
    bundled = r["computed"][0]
    restore_ms = stages["from_bytes"]["median_ms"] + stages["restore"]["median_ms"]
    return "\n".join([
        "# Sessions that survive: snapshot size, snapshot cost, resume latency", "",
        describe(r["provenance"]), "",
        f"Command: `{r['command']}`, {r['elapsed_s']:.0f} s. Written by the command; do not "
        f"edit by hand. Bound `{r['policy']}`, blocks of {r['block_size']} tokens, the bundled "
        f"model in {r['dtype']}. A snapshot holds a session's resident blocks (its sink block "
        "and window, every layer), its position, unconsumed input, budget, sampler state and "
        "spec (`engine.snapshot`).", "",
        "## Snapshot bytes per session", "",
        f"**Measured** (bundled model, a session {m['session_tokens']} tokens long holding "
        f"{m['blocks']} blocks): {m['bytes']:,} bytes serialized, of which KV "
        f"{m['kv_bytes']:,} ({_mb(m['bytes'])}); computed for the same: "
        f"{bundled['bytes']:,} bytes of KV. **Computed** rows: the bound's steady block count "
        "x block size x KV bytes per token (2 x layers x KV heads x head dim x dtype bytes); "
        "presets in bf16, no weights loaded. 'At S+W' counts exactly S + W tokens, the "
        "blocks column what the block-granular table holds. A 7B's size is set by its KV "
        "heads: " + ", ".join(f"{c['model']} has {c['kv_heads']}" for c in r["computed"][1:])
        + " (the issue's ~67 MB for a 7B at 516 tokens assumed 8, i.e. GQA).", "",
        md_table(("model", "dtype", "layers x KV heads x head dim", "KV bytes/token", "blocks",
                  "at S+W tokens", "held (blocks)", "source"),
                 [(c["model"], c["dtype"], f"{c['layers']} x {c['kv_heads']} x {c['head_dim']}",
                   f"{c['kv_bytes_per_token']:,}", c["blocks"],
                   _mb(c["bytes_at_s_plus_w"]), _mb(c["bytes"]),
                   "measured " + _mb(m["bytes"]) if i == 0 else "computed")
                  for i, c in enumerate(r["computed"])]),
        "", "## One session: snapshot, bytes, load, restore into another engine", "",
        f"{stages['take']['n']} cycles on one session. `take` runs on the engine thread "
        "between steps (it copies the blocks out); `to_bytes` and `from_bytes` may run on "
        "any thread; `restore` (engine thread of the other engine: allocate its blocks, copy "
        "the KV in) is the engine-side cost of resuming on another replica, without network "
        "or store.", "",
        md_table(("stage", "min ms", "median ms", "p95 ms"),
                 [(name, fmt(st["min_ms"], ".2f"), fmt(st["median_ms"], ".2f"),
                   fmt(st["p95_ms"], ".2f")) for name, st in stages.items()]),
        "", f"Restore into another engine, bytes to a live session (`from_bytes` + "
        f"`restore`): median {restore_ms:.2f} ms.", "",
        f"## Step-time cost of snapshotting every {s['interval_steps']} steps", "",
        f"{s['sessions']} sessions decoding (windows full), {s['rounds']} rounds of "
        f"{s['interval_steps']} steps each way, alternating in one run. 'With' spreads the "
        "engine-thread part (`take` of every session) over the K steps; serializing "
        "(`to_bytes`) can run off the engine thread and is shown apart.", "",
        md_table(("", "min ms/step", "median ms/step"),
                 [("no snapshots", fmt(s["step_plain"]["min_ms"], ".2f"),
                   fmt(s["step_plain"]["median_ms"], ".2f")),
                  ("with snapshots", fmt(s["step_with_snapshots"]["min_ms"], ".2f"),
                   fmt(s["step_with_snapshots"]["median_ms"], ".2f"))]),
        "", f"Overhead: {s['overhead_paired_median']:+.1%} (median of each round against its "
        f"own plain round), {s['overhead_median']:+.1%} (medians), {s['overhead_min']:+.1%} "
        f"(minima); the snapshots' own time spread over K steps is "
        f"{s['take_all']['median_ms'] / s['interval_steps']:.2f} ms/step. Taking all "
        f"{s['sessions']} snapshots at once holds the engine thread "
        f"{s['take_all']['median_ms']:.1f} ms (median; that step's frames wait that long); "
        f"serializing them takes {s['to_bytes_all']['median_ms']:.1f} ms more.", "",
        "## Resume latency through real servers", "",
        f"{sr['resumes']} resumes each way, with the bundled model (`bench.resume_servers`). "
        "**Same server**: one server, a session that answered a question over a text "
        "longer than its window (so it holds a full window of KV); each time its socket "
        "is dropped (FIN), its lease awaited, and the client reconnects with `resume=<id>` "
        "and its token. **Other server**: two servers sharing one checkpoint store "
        f"(`{o['store']}`" + (": the cluster's own session-store actor on a local Ray, each "
        "checkpoint moved through Ray's object store" if o["store"] == "ray" else "") + "); "
        "each time the socket is dropped the client reconnects to the server that does not "
        "hold the session, which claims its checkpoint, opens it in its engine and replays "
        f"the client events logged since (at most {o['replayed_client_events_max']} here). "
        "Client: connect (TCP + WebSocket upgrade) to `metronome.session.resumed` received. "
        "Server: `metronome_session_resume_seconds` (upgrade request to the session live "
        "again; p50/p95 are bucket upper bounds).", "",
        md_table(("", "p50 ms", "p95 ms", "min ms", "mean ms"),
                 [*_latency_rows("same server", sr), *_latency_rows("other server", o)]),
        "", f"Checkpoints the two servers stored meanwhile: {cp['count']:.0f}, "
        f"{_mb(cp['mean_bytes'] or 0)} each on average ({o['checkpoint_bytes']:,} bytes after "
        f"the first answer), {1e3 * (cp['mean_s'] or 0):.2f} ms of engine-thread time each "
        "(the snapshot; serializing runs on a worker thread; "
        "`metronome_session_checkpoint_seconds`, mean). At the "
        "server's default `--checkpoint-interval-s 5` a session costs its engine at most "
        f"that per 5 s: {(cp['mean_s'] or 0) / 5:.3%} of the engine thread per session.", "",
    ])


def _latency_rows(name: str, r: dict) -> list[tuple]:
    client, hist = r["client"], r["server_histogram"]
    return [(f"{name}: client", fmt(client["median_ms"], ".1f"), fmt(client["p95_ms"], ".1f"),
             fmt(client["min_ms"], ".1f"), fmt(client["mean_ms"], ".1f")),
            (f"{name}: server histogram", f"<= {fmt(_scaled(hist['p50_le']), '.1f')}",
             f"<= {fmt(_scaled(hist['p95_le']), '.1f')}", "",
             fmt(_scaled(hist["mean"]), ".1f"))]


def _scaled(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
