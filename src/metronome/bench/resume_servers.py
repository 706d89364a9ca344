"""Resume latency through real servers (`metronome bench resume`, parts 3 and 4).

* **Same server**: one `ServerThread` (the bundled model) with a session that has answered a
  question over a text longer than its window (so it holds a full window of KV); R times its
  socket is dropped (FIN), the lease awaited, and the client reconnects with `resume=<id>`
  and its token.
* **Other server**: two `ServerThread`s sharing one checkpoint store (`store`: `ray`, the
  cluster's own `cluster.session_store` actor on a local Ray, or `memory`); the session
  moves a -> b -> a ... R times: each time its socket is dropped and the client reconnects
  to the server that does not hold it, which claims the checkpoint from the store, opens it
  in its engine and replays the client events logged since (`serve.resume.takeover`).

Client latency: connect (TCP + WebSocket upgrade) to `metronome.session.resumed` received.
Server: its `metronome_session_resume_seconds` histogram (bucket upper bounds).
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections.abc import Callable

# A conversation past the bound's window (S + W = 516 tokens by default), so the resumed
# session holds a full window of KV: the checkpoint a long conversation has (~12.5 MB here).
CONTEXT = " ".join(["The quick brown fox jumps over the lazy dog."] * 64)
QUESTION = "Remember this text. " + CONTEXT + " What animal jumps?"
STORES = ("ray", "memory")


def ms_stats(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"min_ms": ordered[0] * 1e3, "median_ms": statistics.median(ordered) * 1e3,
            "p95_ms": p95 * 1e3, "mean_ms": statistics.fmean(ordered) * 1e3,
            "n": len(ordered)}


def _drop(ws) -> None:
    """The socket goes without a close frame (a FIN), as a lost connection does."""
    ws.socket.shutdown(socket.SHUT_RDWR)
    ws.socket.close()


def _wait(condition: Callable[[], object], what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.01)
    return value


def _leased(url: str, session_id: str) -> bool:
    import httpx

    listed = {s["id"]: s for s in httpx.get(url + "/v1/sessions").json()["data"]}
    return listed.get(session_id, {}).get("connection") == "leased"


def histogram(urls: list[str], name: str) -> dict:
    """`name`'s histogram summed over the servers at `urls`: count, mean, and the bucket
    bounds holding the median and the 95th percentile."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    count = total = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for s in family.samples:
                if s.name == name + "_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
                elif s.name == name + "_count":
                    count += s.value
                elif s.name == name + "_sum":
                    total += s.value

    def quantile(q: float) -> float | None:
        return next((le for le, n in sorted(buckets.items()) if count and n >= q * count), None)

    return {"count": count, "mean": total / count if count else None,
            "p50_le": quantile(0.5), "p95_le": quantile(0.95)}


def _open_answered(url: str):
    """A session opened on the server at `url` (ws URL) that has answered QUESTION (its
    window full): the socket, session id and resume token."""
    from websockets.sync.client import connect

    from metronome.serve.protocol import with_extensions

    ws = connect(with_extensions(url))
    session = json.loads(ws.recv(timeout=30))["session"]
    ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": QUESTION}]}}))
    ws.send(json.dumps({"type": "response.create"}))
    while json.loads(ws.recv(timeout=60))["type"] != "response.done":
        pass  # the session holds a conversation's KV before it is dropped
    return ws, session["id"], session["metronome"]["resume"]["token"]


def _resume(server, session_id: str, token: str):
    """Reconnect to `server` with the token: the socket, the resumed event, seconds taken."""
    from websockets.sync.client import connect

    from metronome.serve.protocol import with_extensions
    from metronome.serve.resume import RESUME_QUERY, TOKEN_HEADER

    url = with_extensions(server.ws_url) + f"&{RESUME_QUERY}={session_id}"
    started = time.perf_counter()
    ws = connect(url, additional_headers={TOKEN_HEADER: token})
    event = json.loads(ws.recv(timeout=30))
    seconds = time.perf_counter() - started
    assert event["type"] == "metronome.session.resumed", event
    return ws, event, seconds


def _config(**update):
    from metronome.serve.config import ServerConfig

    return ServerConfig(mode="turn", admission="off", pool_tokens=8192, response_tokens=8,
                        resume_grace_s=30.0, **update)


def measure_same_server(model, resumes: int) -> dict:
    from metronome.model.weights import load_tokenizer
    from metronome.observe.metrics import SESSION_RESUME_SECONDS
    from metronome.serve.server import ServerThread

    latencies, away = [], []
    with ServerThread(_config(), model, load_tokenizer()) as server:
        ws, session_id, token = _open_answered(server.ws_url)
        for _ in range(resumes):
            _drop(ws)
            _wait(lambda: _leased(server.url, session_id), f"session {session_id} leased")
            ws, event, seconds = _resume(server, session_id, token)
            latencies.append(seconds)
            token = event["session"]["metronome"]["resume"]["token"]  # each resumes once
            away.append(event["resumed"]["away_s"])
            for _ in range(event["resumed"]["replayed_events"]):
                ws.recv(timeout=10)
        ws.close()
        server_side = histogram([server.url], SESSION_RESUME_SECONDS)
    return {"resumes": resumes, "client": ms_stats(latencies), "server_histogram": server_side,
            "away_s_median": statistics.median(away), "client_s": latencies}


class _Store:
    """The checkpoint store both servers share, and a way to read one session's entry."""

    def __init__(self, kind: str) -> None:
        if kind not in STORES:
            raise ValueError(f"store must be one of {STORES}, not {kind!r}")
        self.kind = kind
        if kind == "memory":
            from metronome.serve.checkpoint import MemoryCheckpointStore

            self.store = MemoryCheckpointStore()
            self.describe = self.store.shelf.describe
            return
        import ray

        from metronome.cluster.session_store import RayCheckpointStore, store_handle

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        handle = store_handle(expire_after_s=300.0, max_bytes=1 << 30)
        self.store = RayCheckpointStore(handle)
        self.describe = lambda session_id: ray.get(handle.describe.remote(session_id))

    def close(self) -> None:
        if self.kind == "ray":
            import ray

            ray.shutdown()


def measure_other_server(model, resumes: int, store_kind: str) -> dict:
    """The session moves between two servers through the store `resumes` times."""
    from metronome.model.weights import load_tokenizer
    from metronome.observe.metrics import (
        SESSION_CHECKPOINT_BYTES,
        SESSION_CHECKPOINT_SECONDS,
        SESSION_RESUME_SECONDS,
    )
    from metronome.serve.server import ServerThread

    store = _Store(store_kind)
    config, tokenizer = _config(checkpoint_interval_s=0.1), load_tokenizer()
    latencies, replayed = [], []
    try:
        with ServerThread(config, model, tokenizer, checkpoint_store=store.store,
                          server_name="a") as a, ServerThread(
                config, model, tokenizer, checkpoint_store=store.store, server_name="b") as b:
            servers = {"a": a, "b": b}
            ws, session_id, token = _open_answered(a.ws_url)
            entry = _wait(lambda: (e := store.describe(session_id)) and e["client_seq"] >= 2
                          and e, "the checkpoint after the answer")
            checkpoint_bytes = entry["checkpoint_bytes"]
            for k in range(resumes):
                name = "b" if k % 2 == 0 else "a"
                _drop(ws)
                ws, event, seconds = _resume(servers[name], session_id, token)
                assert event["resumed"]["from_checkpoint"], event
                latencies.append(seconds)
                replayed.append(event["resumed"]["replayed_client_events"])
                token = event["session"]["metronome"]["resume"]["token"]
                _wait(lambda name=name: (e := store.describe(session_id)) and e["owner"] == name
                      and e["resumable"], f"the store to take {name}'s new token")
            ws.close()
            urls = [a.url, b.url]
            server_side = histogram(urls, SESSION_RESUME_SECONDS)
            sizes = histogram(urls, SESSION_CHECKPOINT_BYTES)
            checkpoint_s = histogram(urls, SESSION_CHECKPOINT_SECONDS)
    finally:
        store.close()
    return {"resumes": resumes, "store": store_kind, "client": ms_stats(latencies),
            "server_histogram": server_side, "client_s": latencies,
            "replayed_client_events_max": max(replayed), "checkpoint_bytes": checkpoint_bytes,
            "checkpoints": {"count": checkpoint_s["count"], "mean_s": checkpoint_s["mean"],
                            "p95_le_s": checkpoint_s["p95_le"],
                            "mean_bytes": sizes["mean"]}}
