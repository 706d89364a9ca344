"""`metronome bench resume`: what it costs to keep a bounded session resumable.

(1) Snapshot bytes per session: measured for the bundled model (a session past its window),
computed for `preset:moshi-7b` and `preset:qwen2.5-omni-7b` from their shapes at the bound's
steady block count in bf16. (2) One session's snapshot moved to another engine, stage by
stage: take, to_bytes, from_bytes, restore. (3) The step-time cost of snapshotting every
session every K steps: N bounded sessions decoding, K steps with and without the snapshots,
interleaved. (4) Resume latency through real servers (`bench.server`, in this process: two of
them share one checkpoint store), interleaved: a session dropped and resumed on its own
server, and one resumed each time on the server that does not hold it, through the `ray`
(the cluster's session store, on a local Ray) or `memory` store. Client latency: connect to
`metronome.session.resumed`. Derived number: the median resume on another server, in ms.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from metronome.bench.presets import knob
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived
from metronome.workload_defaults import POLICY_SPEC

NAME = "resume"
PRESETS = ("moshi-7b", "qwen2.5-omni-7b")
# past the bound's window (S + W = 516 tokens by default): a resumed session holds a full one
QUESTION = ("Remember this text. " + " ".join(["The quick brown fox jumps over the lazy dog."]
                                              * 64) + " What animal jumps?")


@dataclass(frozen=True)
class Config:
    dtype: str = knob("auto", "the bundled model's dtype")
    policy: str = knob(POLICY_SPEC, "every session's bound")
    snapshots: int = knob(40, "snapshot cycles timed on one session")
    sessions: int = knob(16, "sessions decoding in the step-cost part")
    interval_steps: int = knob(16, "K: every session is snapshotted once every K steps")
    rounds: int = knob(12, "rounds of K steps, each with and without snapshots")
    resumes: int = knob(40, "resumes timed on each arm")
    store: str = knob("ray", "the other-server arm's store: ray or memory")

    def __post_init__(self) -> None:
        if self.store not in ("ray", "memory"):
            raise ValueError(f"store must be ray or memory, not {self.store!r}")

    @classmethod
    def smoke(cls) -> Config:
        return cls(policy="sinks_window:4:64", snapshots=3, sessions=2, interval_steps=4,
                   rounds=2, resumes=3, store="memory")


def sizes(model, policy) -> list[dict]:
    import torch

    from metronome.model.config import PRESETS as SHAPES

    rows = []
    for name, cfg, dtype in (("bundled", model.config, model.dtype),
                             *((f"preset:{n}", SHAPES[n], torch.bfloat16) for n in PRESETS)):
        blocks, per_token = policy.max_blocks(16), cfg.kv_bytes_per_token(dtype)
        rows.append({"model": name, "dtype": str(dtype).removeprefix("torch."),
                     "shape": f"{cfg.num_layers} x {cfg.num_kv_heads} x {cfg.head_dim}",
                     "kv_bytes_per_token": per_token, "blocks": blocks,
                     "kv_bytes": blocks * 16 * per_token})
    return rows


class Cycle:
    """One session's snapshot, stage by stage, into another engine (closed there after)."""

    def __init__(self, source, target, sid: str) -> None:
        self.source, self.target, self.sid, self.restored = source, target, sid, None

    def take(self) -> None:
        self.snapshot = self.source.snapshot_session(self.sid)

    def to_bytes(self) -> None:
        self.data = self.snapshot.to_bytes()

    def from_bytes(self) -> None:
        from metronome.engine.snapshot import SessionSnapshot

        self.loaded = SessionSnapshot.from_bytes(self.data)

    def close(self) -> None:
        if self.restored is not None:
            self.target.close(self.restored.id)

    def restore(self) -> None:
        from metronome.stream import Stream

        self.restored = Stream.of()
        assert self.target.restore_session(self.loaded, self.restored), "the pool holds one"


class Resume:
    """A session that answered QUESTION, dropped (no close frame) and resumed, again and
    again: on its own server (one given), or each time on the one not holding it (two given,
    sharing a store: `describe` reads the store's entry)."""

    def __init__(self, loop, servers: list, describe=None) -> None:
        from metronome.load.client import Connection

        self.loop, self.servers, self.describe = loop, servers, describe
        self.k, self.replayed = 0, []
        self.conn = self.run(Connection.open(servers[0].ws_url, timeout_s=30))
        self.sid = self.conn.session["id"]
        self.run(self.conn.ask(QUESTION, 60))
        self.settle()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    def settle(self) -> None:
        """After a resume: its new token, the events it replays, the store's entry."""
        self.token = self.conn.session["metronome"]["resume"]["token"]
        for _ in range(self.conn.opened.get("resumed", {}).get("replayed_events", 0)):
            self.run(self.conn.recv(10))
        if self.describe:
            owner = self.servers[self.k % len(self.servers)].name
            self.wait(lambda: (e := self.describe(self.sid)) and e["owner"] == owner and e[
                "resumable"] and e["client_seq"] >= 2, f"the store to hold {owner}'s session")

    def prepare(self) -> None:
        import httpx

        if self.k:
            self.settle()
        self.run(self.conn.drop())
        url = self.servers[0].url
        if not self.describe:
            self.wait(lambda: {s["id"]: s for s in httpx.get(url + "/v1/sessions").json()[
                "data"]}.get(self.sid, {}).get("connection") == "leased", "the lease")
        self.k += 1

    def step(self) -> None:
        from metronome.load.client import Connection

        server = self.servers[self.k % len(self.servers)]
        self.conn = self.run(Connection.open(server.ws_url, resume=(self.sid, self.token)))
        assert self.conn.opened["type"] == "metronome.session.resumed", self.conn.opened
        self.replayed.append(self.conn.opened["resumed"]["replayed_client_events"])


def histogram(urls: list[str], name: str) -> dict:
    """`name`'s histogram over the servers: count, mean, the buckets holding p50 and p95."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    buckets, count, total = {}, 0.0, 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for s in family.samples:
                if s.name == name + "_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                count += s.value if s.name == name + "_count" else 0
                total += s.value if s.name == name + "_sum" else 0
    q = {p: next((le for le, n in sorted(buckets.items()) if count and n >= p * count), None)
         for p in (0.5, 0.95)}
    return {"count": count, "mean": total / count if count else None, "p50_le": q[0.5],
            "p95_le": q[0.95]}


def _servers(model, tokenizer, store_kind: str):
    """Three servers: one alone, two sharing a checkpoint store; and the store's reader."""
    from metronome.bench.server import Server
    from metronome.serve.config import ServerConfig

    config = ServerConfig(mode="turn", admission="off", pool_tokens=8192, response_tokens=8,
                          resume_grace_s=30.0)
    if store_kind == "memory":
        from metronome.serve.resume.checkpoint import MemoryCheckpointStore

        store = MemoryCheckpointStore()
        describe = store.shelf.describe
    else:
        import ray

        from metronome.cluster.session_store import RayCheckpointStore, store_handle

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        handle = store_handle(expire_after_s=300.0, max_bytes=1 << 30)
        store = RayCheckpointStore(handle)
        describe = lambda sid: ray.get(handle.describe.remote(sid))  # noqa: E731
    shared = config.model_copy(update={"checkpoint_interval_s": 0.1})
    servers = [Server.in_process(config, model, tokenizer)] + [
        Server.in_process(shared, model, tokenizer, checkpoint_store=store, server_name=name)
        for name in ("a", "b")]
    for server, name in zip(servers, ("alone", "a", "b"), strict=True):
        server.name = name
    return servers, describe


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.bench import systems as sy
    from metronome.bench.engine.facts import BUNDLED_MODEL, dtype_name
    from metronome.bench.steps import Steps, interleave, stats
    from metronome.kv.residency import ResidencyPolicy
    from metronome.model.weights import load_tokenizer

    model, policy = sy.load_model(cfg.dtype), ResidencyPolicy.parse(cfg.policy)
    ctx.record(model=BUNDLED_MODEL, dtype=dtype_name(model.dtype), store=cfg.store)
    depth = policy.sink_tokens + policy.window_tokens + 32  # past the window
    source, target = (sy.native(model, sy.pool_tokens(policy, 1, depth, 64)) for _ in range(2))
    sid = sy.open_sessions(source, 1, policy)[0]
    source.submit(sid, [(7 * i + 11) % 1000 + 100 for i in range(depth)], max_new_tokens=1)
    while source.has_work:
        source.step()
    cycle = Cycle(source, target, sid)
    stages = interleave({"take": cycle.take, "to_bytes": cycle.to_bytes, "from_bytes":
                         cycle.from_bytes, "restore": Steps(cycle.restore, cycle.close)},
                        cfg.snapshots, warmup=0, rotate=False)
    measured = {"bytes": len(cycle.data), "kv_bytes": cycle.snapshot.kv_bytes,
                "session_tokens": source.session_tokens(sid), "blocks": source.session_blocks(sid)}
    K, n = cfg.interval_steps, cfg.sessions
    engine = sy.native(model, sy.pool_tokens(policy, n, depth, 64))
    sids = sy.open_sessions(engine, n, policy, depth)
    decode = sy.Decode(engine, sids, (2 * cfg.rounds + 2) * K)
    plain = lambda: [decode.step() for _ in range(K)]  # noqa: E731
    taken = interleave({"no snapshots": plain, "snapshots": lambda: (plain(), [
        engine.snapshot_session(s) for s in sids])}, cfg.rounds)
    step_cost = [{"arm": arm, "sessions": n, "interval_steps": K} | {
        k: stats(t)[k] / K for k in ("median_ms", "min_ms", "p95_ms")} for arm, t in taken.items()]
    ctx.log("resumes through servers")
    loop, arms = asyncio.new_event_loop(), {}
    servers, describe = _servers(model, load_tokenizer(), cfg.store)
    try:
        arms["same server"] = Resume(loop, servers[:1])
        arms["other server"] = Resume(loop, servers[1:], describe)
        times = interleave(arms, cfg.resumes, warmup=0)
        resumes = [{"arm": arm, "replayed_client_events_max": max(arms[arm].replayed)}
                   | stats(t) | {"server_" + k: v for k, v in histogram(
                       [s.url for s in (servers[:1] if arm == "same server" else servers[1:])],
                       "metronome_session_resume_seconds").items()} for arm, t in times.items()]
        checkpoints = [{"what": what} | histogram([s.url for s in servers[1:]], metric)
                       for what, metric in (("bytes", "metronome_session_checkpoint_bytes"),
                                            ("seconds", "metronome_session_checkpoint_seconds"))]
    finally:
        for arm in arms.values():
            arm.run(arm.conn.close())
        for server in servers:
            server.stop()
        loop.close()
        if cfg.store == "ray":
            import ray

            ray.shutdown()
    return REPORT.finish(ctx, {
        "config": asdict(cfg), "sizes": sizes(model, policy), "measured": measured,
        "stages": [{"stage": s} | stats(t) for s, t in stages.items()],
        "step_cost": step_cost, "resumes": resumes, "checkpoints": checkpoints,
        "rounds": [{"arm": arm, "round": k, "ms": ms} for arm, t in times.items()
                   for k, ms in enumerate(stats(t)["round_medians_ms"])],
        "derived": derived("median resume on another server, connect to resumed (ms)",
                           resumes[1]["median_ms"])})


REPORT = Report("Sessions that survive: snapshot size, snapshot cost, resume latency",
                spec=".1f", tables=(
    Table("Snapshot of one session (measured)", "measured"),
    Table("KV bytes per session at the bound (computed)", "sizes"),
    Table("One snapshot into another engine, by stage (ms)", "stages", (
        ("stage", "stage", ""), ("median", "median_ms", ".3f"), ("min", "min_ms", ".3f"),
        ("p95", "p95_ms", ".3f"), ("n", "n", ""))),
    Table("Step time with every session snapshotted every K steps (ms per step)", "step_cost", (
        ("arm", "arm", ""), ("N", "sessions", ""), ("K", "interval_steps", ""),
        ("median", "median_ms", ".2f"), ("min", "min_ms", ".2f"), ("p95", "p95_ms", ".2f"))),
    Table("Resume latency (client: connect to resumed, ms; server: its histogram, s)",
          "resumes", (("arm", "arm", ""), ("median", "median_ms", ".1f"),
                      ("min", "min_ms", ".1f"), ("p95", "p95_ms", ".1f"), ("n", "n", ""),
                      ("server p50 <=", "server_p50_le", ""), ("server mean", "server_mean", ".4f"),
                      ("client events replayed, max", "replayed_client_events_max", ""))),
    Table("Checkpoints the two servers stored meanwhile", "checkpoints")),
    plots=(Plot("{stem}.png", "rounds", x="round", ys=("ms",), series="arm"),))
report = REPORT.markdown
