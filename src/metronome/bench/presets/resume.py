"""`metronome bench resume`: what keeping a bounded session resumable costs: a snapshot's
bytes; N sessions' step time with and without a snapshot of each every K steps, interleaved;
resume latency (connect to `metronome.session.resumed`) through in-process servers,
interleaved: back on its own server, and each time on the server not holding it through the
`ray` store (the cluster's) or `memory`. Derived number: the median resume on another server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import httpx

from metronome.bench import systems as sy
from metronome.bench.engine.facts import BUNDLED_MODEL, dtype_name
from metronome.bench.presets import Knobs, knob
from metronome.bench.server import Server
from metronome.bench.steps import interleave, stats
from metronome.kv.residency import ResidencyPolicy
from metronome.load.client import Connection
from metronome.model.weights import load_tokenizer
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived
from metronome.serve.config import ServerConfig
from metronome.workload_defaults import POLICY_SPEC

NAME = "resume"
# past the bound's window (S + W = 516 tokens by default): a resumed session holds a full one
QUESTION = ("Remember this text. " + " ".join(["The quick brown fox jumps over the lazy dog."]
                                              * 64) + " What animal jumps?")


@dataclass(frozen=True)
class Config(Knobs):
    dtype: str = knob("auto", "the bundled model's dtype")
    policy: str = knob(POLICY_SPEC, "every session's bound")
    sessions: int = knob(16, "sessions decoding in the step-cost part")
    interval_steps: int = knob(16, "K: every session is snapshotted once every K steps")
    rounds: int = knob(12, "rounds of K steps, each with and without snapshots")
    resumes: int = knob(40, "resumes timed on each arm")
    store: str = knob("ray", "the other-server arm's store: ray or memory")

    def __post_init__(self) -> None:
        if self.store not in ("ray", "memory"):
            raise ValueError(f"store must be ray or memory, not {self.store!r}")

    SMOKE = dict(policy="sinks_window:4:64", sessions=2, interval_steps=4,
                 rounds=2, resumes=3, store="memory")


class Resume:
    """A session that answered QUESTION, dropped (no close frame) and resumed again and
    again: on its own server (one given) or each time on the one not holding it (two,
    sharing a store: `describe` reads the store's entry)."""

    def __init__(self, loop, servers: list, describe=None) -> None:
        self.run, self.servers, self.describe = loop.run_until_complete, servers, describe
        self.conn = self.run(Connection.open(servers[0].ws_url, timeout_s=30))
        self.sid, self.k, self.replayed = self.conn.session["id"], 0, []
        self.run(self.conn.ask(QUESTION, 60))

    def wait(self, condition, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)

    def prepare(self) -> None:
        """The last resume's new token and replayed events; the store's entry; the drop."""
        self.token = self.conn.session["metronome"]["resume"]["token"]
        for _ in range(self.conn.opened.get("resumed", {}).get("replayed_events", 0)):
            self.run(self.conn.recv(10))
        if self.describe:
            owner = self.servers[self.k % 2].name
            self.wait(lambda: (e := self.describe(self.sid)) and e["owner"] == owner
                      and e["resumable"] and e["client_seq"] >= 2, f"{owner}'s checkpoint")
        self.run(self.conn.drop())
        url = self.servers[0].url
        if not self.describe:
            self.wait(lambda: {s["id"]: s for s in httpx.get(url + "/v1/sessions").json()[
                "data"]}.get(self.sid, {}).get("connection") == "leased", "the lease")
        self.k += 1

    def step(self) -> None:
        server = self.servers[self.k % len(self.servers)]
        self.conn = self.run(Connection.open(server.ws_url, resume=(self.sid, self.token)))
        assert self.conn.opened["type"] == "metronome.session.resumed", self.conn.opened
        self.replayed.append(self.conn.opened["resumed"]["replayed_client_events"])


def servers(model, tokenizer, store_kind: str):
    """One server alone and two sharing a checkpoint store; and the store's reader."""
    config = ServerConfig(mode="turn", audio_input="embeddings", output_audio=False,
                          server_vad=False, admission="off", pool_tokens=8192,
                          max_response_tokens=8, resume_grace_s=30.0)
    if store_kind == "memory":
        from metronome.serve.resume.checkpoint import MemoryCheckpointStore

        store = MemoryCheckpointStore()
        describe = store.shelf.describe
    else:
        import ray

        from metronome.cluster.session_store import RayCheckpointStore, store_handle

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        handle = store_handle(expire_after_s=300.0, max_bytes=1 << 30)
        store, describe = RayCheckpointStore(handle), lambda sid: ray.get(
            handle.describe.remote(sid))
    shared = config.model_copy(update={"checkpoint_interval_s": 0.1})
    started = [Server.in_process(config, model, tokenizer)] + [Server.in_process(
        shared, model, tokenizer, checkpoint_store=store, server_name=name) for name in "ab"]
    for server, name in zip(started, ("alone", "a", "b"), strict=True):
        server.name = name
    return started, describe


def run(ctx: RunContext, cfg: Config) -> dict:
    model, policy = sy.load_model(cfg.dtype), ResidencyPolicy.parse(cfg.policy)
    ctx.record(model=BUNDLED_MODEL, dtype=dtype_name(model.dtype), store=cfg.store)
    depth = policy.sink_tokens + policy.window_tokens + 32  # past the window
    source = sy.native(model, sy.pool_tokens(policy, 1, depth, 64))
    sid = sy.open_sessions(source, 1, policy)[0]
    source.submit(sid, [(7 * i + 11) % 1000 + 100 for i in range(depth)], max_new_tokens=1)
    while source.has_work:
        source.step()
    snapshot = source.snapshot_session(sid)
    K, n = cfg.interval_steps, cfg.sessions
    engine = sy.native(model, sy.pool_tokens(policy, n, depth, 64))
    sids = sy.open_sessions(engine, n, policy, depth)
    decode = sy.Decode(engine, sids, (2 * cfg.rounds + 2) * K)
    plain = lambda: [decode.step() for _ in range(K)]  # noqa: E731
    taken = interleave({"no snapshots": plain, "snapshots": lambda: (plain(), [
        engine.snapshot_session(s) for s in sids])}, cfg.rounds)
    loop, arms = asyncio.new_event_loop(), {}
    started, describe = servers(model, load_tokenizer(), cfg.store)
    try:
        arms["same server"] = Resume(loop, started[:1])
        arms["other server"] = Resume(loop, started[1:], describe)
        times = interleave(arms, cfg.resumes, warmup=0)
    finally:
        for arm in arms.values():
            arm.run(arm.conn.close())
        for server in started:
            server.stop()
        loop.close()
        if cfg.store == "ray":
            import ray

            ray.shutdown()
    resumes = [{"arm": arm, "replayed_client_events_max": max(arms[arm].replayed)}
               | stats(t) for arm, t in times.items()]
    return REPORT.finish(ctx, {
        "config": asdict(cfg), "snapshot": {"bytes": len(snapshot.to_bytes()), "kv_bytes":
                                            snapshot.kv_bytes, "session_tokens": depth,
                                            "blocks": source.session_blocks(sid)},
        "step_cost": [{"arm": arm, "sessions": n, "K": K} | {
            f"{k}_per_step": stats(t)[k] / K for k in ("median_ms", "min_ms", "p95_ms")}
            for arm, t in taken.items()], "resumes": resumes,
        "derived": derived("median resume on another server, connect to resumed (ms)",
                           resumes[1]["median_ms"])})


REPORT = Report("Sessions that survive: snapshot size, snapshot cost, resume latency",
                spec=".1f", tables=(
    Table("A snapshot past the window", "snapshot"),
    Table("Step time with every session snapshotted every K steps (ms)", "step_cost"),
    Table("Resume latency, connect to resumed (ms)", "resumes")))
report = REPORT.markdown
