"""Attacks on `metronome serve` (a subprocess on 127.0.0.1, with an API key): lone UTF-16
surrogates, messages that are costly to validate, message floods, a client that never
reads, slowloris, the key's surface, and four that stay inside every per-connection limit
(text that is costly to tokenize, a reconnecting slowloris, headers past the cap in one
send, refusals that must echo the client's event_id). Each of those four runs in an
`AttackWindow`: while it runs the streamer's frames are on time and the server's loop lag
(its probe timer's histogram) stays under 50 ms, and after it sessions, KV blocks and
connections are back to where they were. Attackers other than the reference clients
connect from other loopback addresses (127.0.0.2 and up), as other peers. A well-behaved
session streams speech beside them the whole time: it keeps >= 99 % of its frames on time,
and the server's resident memory (VmRSS in /proc/<pid>/status) stays within RSS_BOUND_MB of
where it was when they began.
That verdict is the server fixture's, given when it ends, over whichever attacks ran (all
of them, in any order, or one), so no test depends on another having run before it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import selectors
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest
from openai import AsyncOpenAI
from served import SHARED_CPU_ENV, free_port, metric_samples, served
from streamer import SpeechStreamer, recv
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from metronome.corpus import play_text
from metronome.serve.config import ServerConfig
from metronome.serve.edge.loop_lag import LOOP_LAG_SECONDS
from tests.host_speed import deadline_fraction, host_slowness
from tests.served import TEXT_DUPLEX

pytestmark = pytest.mark.model
KEY = "sk-attack-test"
BEARER = {"Authorization": f"Bearer {KEY}"}
BROWSER = ["realtime", f"openai-insecure-api-key.{KEY}"]  # what OpenAI's browser clients send
REQUEST_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 200
CONFIG = ServerConfig(**TEXT_DUPLEX, pool_tokens=4096, admission="off", api_key=KEY,
                      request_timeout_s=REQUEST_TIMEOUT_S, max_connections=MAX_CONNECTIONS)
RSS_BOUND_MB = 64.0  # growth over the whole suite; the non-reader alone grew 14-18 MB/s
MIN_FLOOD_MESSAGES = 2000
MIN_ON_TIME = 0.99
MIN_STREAMER_FRAMES = 20


class RssSampler:
    """VmRSS of a process every 50 ms, on a thread, until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples_mb: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read_mb(self) -> float:
        with open(f"/proc/{self.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples_mb.append(self.read_mb())

    def start(self) -> RssSampler:
        self.samples_mb.append(self.read_mb())
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class World:
    url: str
    pid: int
    streamer: SpeechStreamer
    rss: RssSampler
    health_port: int = 0  # the health listener's

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws", 1) + "/v1/realtime"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}"

    def health(self) -> dict:
        return httpx.get(self.url + "/healthz", headers=BEARER).json()

    def door_count(self, reason: str) -> float:
        """What the door refused or evicted for `reason` so far (/metrics)."""
        return next(sample.value for sample in metric_samples(
            self, "metronome_door_refusals_total", headers=BEARER)
            if sample.labels["reason"] == reason)

    def server_sockets(self) -> list:
        """The server's established TCP connections."""
        return [c for c in psutil.Process(self.pid).net_connections(kind="tcp")
                if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == self.port]


def server_pid(port: int) -> int:
    """The child process serving on `port` (its config, as JSON, ends its command line)."""
    for child in psutil.Process().children():
        with contextlib.suppress(ValueError, TypeError, KeyError, IndexError):
            if json.loads(child.cmdline()[-1])["port"] == port:
                return child.pid
    raise LookupError(f"no child process serves port {port}")


@pytest.fixture(scope="module")
def world():
    # The streamer's 1 s deadline was set on the reference host, where its frames took
    # 0.3-0.46 of it through every attack; a Zen 1-class host takes 0.35-0.53 of it calm and
    # up to 1.0 under the attacks, so the deadline scales with the host (`tests.host_speed`).
    config = CONFIG.model_copy(update={"deadline_fraction": deadline_fraction(1.0),
                                       "health_port": free_port()})
    print(f"streamer deadline on this host: {config.deadline_fraction:.2f} s")
    with served(config, SHARED_CPU_ENV) as url:
        pid = server_pid(int(url.rsplit(":", 1)[1]))
        streamer = SpeechStreamer(url.replace("http", "ws", 1) + "/v1/realtime",
                                  additional_headers=BEARER)
        streamer.start()
        rss = RssSampler(pid).start()
        yield World(url, pid, streamer, rss, config.health_port)
        streamer_kept_its_beat_and_memory_stayed_bounded(streamer, rss)


def streamer_kept_its_beat_and_memory_stayed_bounded(streamer: SpeechStreamer,
                                                     rss: RssSampler) -> None:
    """The verdict over the attacks that ran: the streamer (after MIN_STREAMER_FRAMES at
    least) kept its beat and the server's memory stayed bounded."""
    deadline = time.monotonic() + MIN_STREAMER_FRAMES + 5
    while streamer.sent_bytes < MIN_STREAMER_FRAMES * 48000:
        assert time.monotonic() < deadline, "the streamer fell behind real time"
        time.sleep(0.1)
    sent_frames = streamer.stop()
    rss.stop()
    frames = streamer.frames
    assert len(frames) == sent_frames and streamer.errors == []
    on_time = 1 - len(streamer.late_frames) / len(frames)
    grown_mb = max(rss.samples_mb) - rss.samples_mb[0]
    slowest = ", ".join(f"{f['index']}: {f['latency_ms']:.0f}" for f in sorted(
        frames, key=lambda f: -f["latency_ms"])[:3])
    print(f"streamer: {len(frames)} frames, {on_time:.1%} on time, slowest (index: ms) "
          f"{slowest}; RSS {rss.samples_mb[0]:.0f} MB, at most {grown_mb:+.1f} MB")
    assert on_time >= MIN_ON_TIME, streamer.late_frames
    assert grown_mb <= RSS_BOUND_MB


def session(world: World, **options):
    ws = connect(world.ws_url, additional_headers=BEARER, **options)
    assert recv(ws)["type"] == "session.created"
    return ws


# ---- 1. lone surrogates ------------------------------------------------------------------------
LONE_SURROGATES = [  # JSON text as sent: the escapes reach the server as written here
    r'{"type": "nope", "event_id": "\ud83d"}',
    r'{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
    r'"content": [{"type": "input_text", "text": "\ud800"}]}}',
    r'{"type": "session.update", "session": {"\udfff": 1}}',
    r'{"type": "conversation.item.create", "event_id": "e1", "item": {"id": "x\udc00", '
    r'"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}',
    r'{"type": "response.create", "response": {"output_modalities": ["\ud83dtext"]}}',
]


def test_lone_surrogates_get_an_error_and_the_session_lives_on(world):
    with session(world) as ws:
        for message in LONE_SURROGATES:
            ws.send(message)
            event = recv(ws)
            assert event["type"] == "error", event
            assert event["error"]["code"] == "invalid_json"
            assert "surrogate" in event["error"]["message"]
        ws.send(json.dumps({"type": "session.update", "session": {}}))
        assert recv(ws)["type"] == "session.updated"
        ws.send(r'{"type": "conversation.item.create", "item": {"type": "message", '
                r'"role": "user", "content": [{"type": "input_text", "text": "\ud83d\ude00"}]}}')
        added = recv(ws)  # a surrogate pair is one character, and welcome
        assert added["item"]["content"][0]["text"] == "\U0001f600"


# ---- 2. messages that are costly to parse or validate -------------------------------------------
COSTLY = [  # each under the 520 KiB message cap; ~0.5 s to validate and ~70 ms to parse before
    json.dumps({"type": "session.update", "session": {"output_modalities": ["x"] * 100_000}},
               separators=(",", ":")),
    '{"type":"session.update","session":{"x":[' + "[]," * 150_000 + "[]]}}",
]


def test_costly_messages_are_refused_in_milliseconds(world):
    assert all(len(message) <= CONFIG.max_message_bytes for message in COSTLY)
    with session(world) as ws:
        for message in COSTLY:
            started = time.monotonic()
            ws.send(message)
            error = recv(ws, 10.0)["error"]
            elapsed_s = time.monotonic() - started
            assert error["code"] == "invalid_json" and "JSON values" in error["message"]
            assert elapsed_s < 0.25, f"{elapsed_s:.3f} s for a {len(message)}-byte message"
            print(f"costly message of {len(message)} bytes: refused in {elapsed_s * 1e3:.1f} ms")


# ---- 3. a message flood -------------------------------------------------------------------------
FLOOD_CONNECTIONS = 4
FLOOD_MESSAGES = 3000  # per connection, at most; the server closes each much sooner


def test_a_flood_is_dropped_past_the_rate_limit_then_closed(world):
    flooders = [session(world, max_queue=None) for _ in range(FLOOD_CONNECTIONS)]
    started = time.monotonic()
    sent = [0] * FLOOD_CONNECTIONS
    open_ids = set(range(FLOOD_CONNECTIONS))
    for _ in range(FLOOD_MESSAGES):
        for k in list(open_ids):
            try:
                flooders[k].send("{}")
                sent[k] += 1
            except ConnectionClosed:
                open_ids.discard(k)
    assert sum(sent) >= MIN_FLOOD_MESSAGES
    for k, ws in enumerate(flooders):
        codes = []
        with pytest.raises(ConnectionClosed) as closed:  # not closed: TimeoutError
            while True:
                codes.append(recv(ws)["error"]["code"])
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1008, "rate limit exceeded")
        answered = codes.count("unknown_event_type")
        refill = 100 * (time.monotonic() - started)  # the rate gives back while it floods
        assert 200 <= answered <= 200 + refill + 1, (k, sent[k], answered, refill)
        assert codes[-1] == "rate_limit_exceeded" and codes.count("rate_limit_exceeded") >= 2
        # (a refusal starting each run over the limit is told; the last is the close)
        print(f"flooder {k}: sent {sent[k]}, answered {answered} (burst 200 + refill "
              f"{refill:.0f})")


# ---- 3b. one read of tiny frames: parsed before any rate limit could see them -------------------
class RoundTrips:
    """A session's `session.update` round trips, every 20 ms, on a thread."""

    def __init__(self, world: World) -> None:
        self.ws = session(world)
        self.rtts_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            started = time.monotonic()
            self.ws.send('{"type": "session.update", "session": {}}')
            while recv(self.ws)["type"] != "session.updated":
                pass
            self.rtts_s.append(time.monotonic() - started)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.ws.close()


# Each kind's read is sent FLOODS_PER_KIND times, and the median flood's worst round trip
# must stay under MEDIAN_FLOOD_BOUND_S: a stall in every flood fails it, while one stray
# stall of a shared 2-core machine does not (CI once saw 135 ms in one flood, against
# 30-50 ms typical). That the guard parses one slice at a time, at the app's pace, is
# tested exactly, without a clock, in tests/serve/test_guard_slicing.py.
FLOODS_PER_KIND = 3
MEDIAN_FLOOD_BOUND_S = 0.1
ONE_READ = {  # 256 KiB each, what the server reads at once: ~0.2-0.3 s to parse whole
    "2-byte messages": bytes([0x81, 0x82]) + b"\0\0\0\0{}",
    "pings": bytes([0x89, 0x80]) + b"\0\0\0\0",
    "1-byte fragments": bytes([0x00, 0x81]) + b"\0\0\0\0x",
}


def _one_read(name: str) -> bytes:
    frame = ONE_READ[name]
    start = bytes([0x01, 0x81]) + b"\0\0\0\0x" if name == "1-byte fragments" else b""
    return start + frame * ((256 << 10) // len(frame))


def test_one_read_of_tiny_frames_does_not_stall_the_loop(world):
    probe = RoundTrips(world)
    time.sleep(0.3)
    calm_s = max(probe.rtts_s)
    worst_s: dict[str, list[float]] = {name: [] for name in ONE_READ}
    for _ in range(FLOODS_PER_KIND):
        for name in ONE_READ:
            seen, started = len(probe.rtts_s), time.monotonic()
            sock = _raw_websocket(world, receive_buffer_bytes=1 << 16)
            sock.sendall(_one_read(name))
            time.sleep(0.5)
            sock.close()
            rtts_s = probe.rtts_s[seen:]  # none: no round trip came back during the flood
            worst_s[name].append(max(rtts_s) if rtts_s else time.monotonic() - started)
    probe.stop()
    floods = sorted(w for kind in worst_s.values() for w in kind)
    print("one read of tiny frames: worst round trip per flood, ms: " + "; ".join(
        f"{name} " + ", ".join(f"{w * 1e3:.0f}" for w in kind)
        for name, kind in worst_s.items()) + f" (calm: {calm_s * 1e3:.0f} ms)")
    assert statistics.median(floods) < MEDIAN_FLOOD_BOUND_S


# ---- 4. a client that never reads ---------------------------------------------------------------
def _frame(text: bytes) -> bytes:
    """One masked client text frame (mask 0: the payload as is)."""
    assert len(text) < 126
    return bytes([0x81, 0x80 | len(text)]) + b"\0\0\0\0" + text


def _raw_websocket(world: World, receive_buffer_bytes: int = 4096) -> socket.socket:
    """A WebSocket that reads its handshake and never another byte, with a small window."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
    sock.connect(("127.0.0.1", world.port))
    sock.sendall(
        "GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _send_until_stuck(sock: socket.socket, batch: bytes, max_batches: int,
                      stuck_s: float = 2.0, limit_s: float = 20.0) -> int:
    """Send `batch` repeatedly; stop when the socket fails, stays full for `stuck_s`, or
    after `max_batches` or `limit_s`. Returns the batches sent (whole or in part)."""
    sock.setblocking(False)
    started = last_progress = time.monotonic()
    sent, pending = 0, b""
    while time.monotonic() - started < limit_s:
        if not pending:
            if sent == max_batches:
                break
            pending, sent = batch, sent + 1
        try:
            pending = pending[sock.send(pending):]
            last_progress = time.monotonic()
        except BlockingIOError:
            if time.monotonic() - last_progress > stuck_s:
                break
            time.sleep(0.002)
        except OSError:  # reset by the server
            break
    return sent


def test_a_client_that_never_reads_is_closed_and_its_socket_dropped(world):
    sessions_before = world.health()["sessions"]
    rss_before_mb = world.rss.read_mb()
    sock = _raw_websocket(world)
    client_port = sock.getsockname()[1]
    batch = _frame(b"{}") * 100  # each answered by an `error` it never reads
    sent_messages = 100 * _send_until_stuck(sock, batch, max_batches=1000)
    stopped = time.monotonic()
    assert sent_messages >= MIN_FLOOD_MESSAGES
    while any(c.raddr.port == client_port for c in world.server_sockets()):
        assert time.monotonic() - stopped < 4.0, "the server still holds the socket"
        time.sleep(0.05)
    assert world.health()["sessions"] == sessions_before
    grown_mb = world.rss.read_mb() - rss_before_mb
    assert grown_mb < 32, f"RSS grew {grown_mb:.0f} MB for {sent_messages} messages"
    sock.close()
    print(f"non-reader: {sent_messages} messages sent, RSS {grown_mb:+.1f} MB")


# ---- 5. slowloris -------------------------------------------------------------------------------
SLOWLORIS_SOCKETS = 800


def test_slowloris_sockets_are_dropped_and_connections_capped(world):
    evicted_before = world.door_count("evicted_half_open")
    selector = selectors.DefaultSelector()
    opened_at: dict[socket.socket, float] = {}
    for k in range(SLOWLORIS_SOCKETS):  # from 20 peers, each within its own limits
        sock = socket.create_connection(("127.0.0.1", world.port),
                                        source_address=(f"127.0.0.{10 + k % 20}", 0))
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        opened_at[sock] = time.monotonic()
    closed_after_s: dict[socket.socket, float] = {}
    refused = 0
    most_held, deadline = 0, time.monotonic() + REQUEST_TIMEOUT_S + 3.0
    next_trickle = time.monotonic() + 0.5
    while opened_at.keys() - closed_after_s.keys() and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.1):
            sock = key.fileobj
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            refused += data.startswith(b"HTTP/1.1 503")
            if not data or data.startswith(b"HTTP/1.1 503"):
                closed_after_s[sock] = time.monotonic() - opened_at[sock]
                selector.unregister(sock)
        if time.monotonic() >= next_trickle:  # one more header line, every 0.5 s
            most_held = max(most_held, len(world.server_sockets()))
            for sock in opened_at.keys() - closed_after_s.keys():
                try:
                    sock.send(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            next_trickle += 0.5
    held = len(opened_at) - len(closed_after_s)
    for sock in opened_at:
        sock.close()
    evicted = world.door_count("evicted_half_open") - evicted_before
    assert held == 0, f"{held} of {SLOWLORIS_SOCKETS} sockets still open"
    assert max(closed_after_s.values()) < REQUEST_TIMEOUT_S + 1.0
    assert most_held <= MAX_CONNECTIONS
    # past the cap each newcomer took the place of the quietest half-open one (or was
    # refused, its peer at its own limits)
    assert refused + evicted >= SLOWLORIS_SOCKETS - MAX_CONNECTIONS
    assert httpx.get(world.url + "/healthz").status_code == 200  # and it serves again
    print(f"slowloris: {refused} refused 503, {evicted:.0f} evicted at the cap, the rest "
          f"dropped within {max(closed_after_s.values()):.2f} s; server held at most "
          f"{most_held}")


# ---- 8. the key ---------------------------------------------------------------------------------
def test_the_key_guards_docs_and_the_upgrade_and_browsers_can_send_it(world):
    for path in ("/docs", "/redoc", "/openapi.json", "/metrics", "/v1/sessions"):
        denied = httpx.get(world.url + path)
        assert denied.status_code == 401, path
        assert denied.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(world.url + path, headers=BEARER).status_code == 200, path
    health = httpx.get(world.url + "/healthz").json()
    assert set(health) == {"status"}
    detailed = world.health()
    assert detailed["status"] == health["status"] and len(detailed) > 1
    for options in ({}, {"additional_headers": {"Authorization": "Bearer nope"}},
                    {"subprotocols": ["realtime", "openai-insecure-api-key.nope"]}):
        with pytest.raises(InvalidStatus) as refused:  # before the upgrade
            connect(world.ws_url, **options)
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"
    with connect(world.ws_url, subprotocols=BROWSER) as ws:
        assert ws.subprotocol == "realtime"
        assert recv(ws)["type"] == "session.created"


# ---- 9. attacks inside every per-connection limit -----------------------------------------------
ATTACK_S = 8.0  # each attack runs this long (its attempts are bounded by it and its rate)
MAX_LOOP_LAG_S = 0.05
SETTLE_S = 1.5  # after an attack: the frame it overlapped is answered
IDLE_TIMEOUT_S = 5.0  # on the reference host (scaled: `idle_timeout_s`)


def idle_timeout_s() -> float:
    """How long an attack's leftovers may take to go (sessions ended, leases let go, blocks
    back, connections closed): IDLE_TIMEOUT_S on the reference host, longer in proportion on
    a slower one (`tests.host_speed.host_slowness`), as the frames' deadlines are."""
    return IDLE_TIMEOUT_S * host_slowness()


def loop_lag_buckets(world: World) -> dict[float, float]:
    """The server's loop-lag probes so far, by histogram bucket (`le` in seconds)."""
    return {float(sample.labels["le"]): sample.value for sample in metric_samples(
        world, LOOP_LAG_SECONDS + "_bucket", headers=BEARER)}


@dataclass(frozen=True)
class Idle:
    """What the server says it holds (`GET /v1/sessions`, `/healthz`): an attack left nothing
    behind when, against the same reading before it, no session is left that was not there,
    none is leased, no KV block is used beyond what the open sessions' resident tokens need,
    and no connection is open beyond those there were."""

    sessions: dict[str, dict]  # by id: as `/v1/sessions` lists it
    leased: int
    extra_blocks: int  # used beyond the open sessions' resident tokens (+1 each: a sink block)
    connections: int

    @classmethod
    def read(cls, world: World) -> Idle:
        listing = httpx.get(world.url + "/v1/sessions", headers=BEARER).json()
        pool = listing["kv_pool"]
        needed = sum(math.ceil((s["resident_kv_tokens"] or 0) / pool["block_size"]) + 1
                     for s in listing["data"])
        return cls({s["id"]: s for s in listing["data"]},
                   sum(s["connection"] == "leased" for s in listing["data"]),
                   max(0, pool["used_blocks"] - needed), len(world.server_sockets()))

    def busy_beyond(self, before: Idle) -> list[str]:
        """What is still held that was not before ([] when back): each left-over session with
        its state and work, the leases, the blocks, the connections."""
        busy = [f"session {sid}: {s['status']}, {s['connection']}, {s['unanswered_frames']} "
                f"frames unanswered, {s['queued_input_tokens']} input tokens queued"
                for sid, s in self.sessions.items() if sid not in before.sessions]
        if self.leased > before.leased:
            busy.append(f"{self.leased} leased sessions (before: {before.leased})")
        if self.extra_blocks > before.extra_blocks:
            busy.append(f"{self.extra_blocks} KV blocks beyond the open sessions' need "
                        f"(before: {before.extra_blocks})")
        if self.connections > before.connections:
            busy.append(f"{self.connections} server connections (before: {before.connections})")
        return busy

    def wait_back(self, world: World, what: str) -> None:
        """Until the server holds no more than it did at this reading; fails after
        `idle_timeout_s()` saying what it still held."""
        timeout_s = idle_timeout_s()
        deadline = time.monotonic() + timeout_s
        while busy := Idle.read(world).busy_beyond(self):
            assert time.monotonic() < deadline, (
                f"{what}: the server still held, {timeout_s:.1f} s after: " + "; ".join(busy))
            time.sleep(0.1)


@dataclass
class AttackWindow:
    """`with AttackWindow(world, name) as attack:` around one attack; `attack.attempts` is
    what the attacker tried. On exit: the streamer's frames answered meanwhile were all on
    time (>= 99 %), no loop-lag probe ran later than MAX_LOOP_LAG_S, and the server let go of
    all the attack made it hold (`Idle`: sessions, leases, blocks, connections) within
    `idle_timeout_s()`, or the failure says what it still held. Prints the row of the results
    table (docs/results/hardening.md)."""

    world: World
    name: str
    attempts: int = 0
    notes: list[str] = field(default_factory=list)

    def __enter__(self) -> AttackWindow:
        self.frames_before = len(self.world.streamer.frames)
        self.lag_before = loop_lag_buckets(self.world)
        self.idle_before = Idle.read(self.world)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            return
        time.sleep(SETTLE_S)
        frames = self.world.streamer.frames[self.frames_before:]
        late = [f for f in frames if f["status"] != "ok" or not f["deadline_met"]]
        after = loop_lag_buckets(self.world)
        probes = {le: after[le] - self.lag_before[le] for le in after}
        worst_le = min(le for le, n in probes.items() if n == probes[math.inf])
        self.idle_before.wait_back(self.world, self.name)
        on_time = 1 - len(late) / max(1, len(frames))
        print(f"| {self.name} | {self.attempts:,} | {len(frames) - len(late)}/{len(frames)} "
              f"| <= {worst_le * 1e3:g} ms ({int(probes[math.inf])} probes) | "
              f"{'; '.join(self.notes)} |")
        assert len(frames) >= ATTACK_S - 2, "the streamer was not answered meanwhile"
        assert on_time >= MIN_ON_TIME, late
        assert probes[MAX_LOOP_LAG_S] == probes[math.inf], probes


def _attacker(source: str) -> dict:
    """`socket.create_connection` options for an attacker at loopback address `source`."""
    return {"source_address": (source, 0)}


# 9a. text that is costly to tokenize: refused before it is tokenized --------------------------
TEXT_ATTACKERS = 3
# 8,192 random CJK characters: 24,576 UTF-8 bytes, more than the session's queued-input bound
# (16,384 tokens) can hold at one token a byte. (8,192 printable ASCII, 8,192 bytes, now fit:
# a turn session's history of 50 items of 200 words needs that bound.)
_COSTLY = "".join(chr(c) for c in range(0x4E00, 0x9FA6))


def test_text_costly_to_tokenize_is_refused_before_it_is_tokenized(world):
    text = "".join(random.Random(25).choice(_COSTLY) for _ in range(8192))
    message = json.dumps({"type": "conversation.item.create", "event_id": "evt_attack",
                          "item": {"type": "message", "role": "user",
                                   "content": [{"type": "input_text", "text": text}]}})
    rate_per_s = min(CONFIG.rate_limit_messages_per_s,  # the byte rate: ~61 msg/s
                     CONFIG.rate_limit_bytes_per_s / len(message)) * 0.98
    attackers: list = []
    sent = [0] * TEXT_ATTACKERS

    def attack(k: int) -> None:
        started = time.monotonic()
        while (elapsed_s := time.monotonic() - started) < ATTACK_S:
            if sent[k] < elapsed_s * rate_per_s:
                attackers[k].send(message)
                sent[k] += 1
            else:
                time.sleep(0.002)

    with AttackWindow(world, f"{TEXT_ATTACKERS} connections x 8,192-char text items at "
                      f"{rate_per_s:.0f} msg/s each") as window:
        attackers += [session(world, max_queue=None) for _ in range(TEXT_ATTACKERS)]
        threads = [threading.Thread(target=attack, args=(k,)) for k in range(TEXT_ATTACKERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for k, ws in enumerate(attackers):
            errors = [recv(ws)["error"] for _ in range(sent[k])]
            assert {(e["code"], e["event_id"]) for e in errors} == {
                ("too_many_pending_frames", "evt_attack")}
            assert "may exceed the limit" in errors[0]["message"]
            ws.close()
        window.attempts = sum(sent)
        window.notes.append("every one refused `too_many_pending_frames` before tokenizing")


# 9b. a reconnecting slowloris from one peer ---------------------------------------------------
RECONNECTING_SOCKETS = 800
MAX_CONNECTS_PER_S = 400  # what the attacker managed (10,976 in 30 s)


class LoopbackConnections:
    """Connections to the server on `port`, each from a loopback source, sending its data
    and closed at the first answer; `answers` counts each answer's label (`label`, or
    "dropped": closed unanswered, "connect failed")."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connects = 0
        self.answers: dict[str, int] = {}
        self.selector = selectors.DefaultSelector()

    @staticmethod
    def label(data: bytes) -> str:
        """What an answer is counted as."""
        return data[:12].decode(errors="replace")  # "HTTP/1.1 503"

    def _open(self, source: str, data: bytes) -> None:
        self.connects += 1
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), **_attacker(source))
            sock.sendall(data)
        except OSError:
            self._count("connect failed")
            return
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ)

    def _read_answers(self, timeout_s: float) -> None:
        for key, _ in self.selector.select(timeout=timeout_s):
            sock = key.fileobj
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            self._close(sock, self.label(data) if data else "dropped")

    def _count(self, answer: str) -> None:
        self.answers[answer] = self.answers.get(answer, 0) + 1

    def _close(self, sock: socket.socket, answer: str | None = None) -> None:
        """Closed, its answer counted (None: not counted)."""
        if answer is not None:
            self._count(answer)
        self.selector.unregister(sock)
        sock.close()

    def _close_all(self, answer: str | None = None) -> None:
        for key in list(self.selector.get_map().values()):
            self._close(key.fileobj, answer)


class ReconnectingSlowloris(LoopbackConnections):
    """Up to `num_sockets` partial upgrades from `source`, each reopened as soon as the
    server refuses or drops it, at most `max_per_s` connects a second, for `duration_s`."""

    PARTIAL = (b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
               b"Connection: Upgrade\r\n")  # never finished

    def __init__(self, port: int, source: str, num_sockets: int, max_per_s: float) -> None:
        super().__init__(port)
        self.source, self.num_sockets, self.max_per_s = source, num_sockets, max_per_s

    def run(self, duration_s: float) -> None:
        started = time.monotonic()
        while (elapsed_s := time.monotonic() - started) < duration_s:
            while (len(self.selector.get_map()) < self.num_sockets
                   and self.connects < elapsed_s * self.max_per_s):
                self._open(self.source, self.PARTIAL)
            self._read_answers(0.005)
        self._close_all()


def test_a_reconnecting_slowloris_holds_only_its_peers_share(world):
    attacker = ReconnectingSlowloris(world.port, "127.0.0.2", RECONNECTING_SOCKETS,
                                     MAX_CONNECTS_PER_S)
    thread = threading.Thread(target=attacker.run, args=(ATTACK_S,))
    per_peer = CONFIG.max_connections_per_peer
    with AttackWindow(world, f"reconnecting slowloris: {RECONNECTING_SOCKETS} partial "
                      f"upgrades from one peer, reopened at once") as window:
        thread.start()
        most_held, healthz, sessions = 0, [], 0
        while thread.is_alive():
            held = [c for c in world.server_sockets() if c.raddr.ip == "127.0.0.2"]
            most_held = max(most_held, len(held))
            healthz.append(httpx.get(world.url + "/healthz").status_code)
            with session(world) as ws:  # an authenticated client gets in and is served
                ws.send(json.dumps({"type": "session.update", "session": {}}))
                assert recv(ws)["type"] == "session.updated"
                sessions += 1
            time.sleep(0.3)
        thread.join()
        window.attempts = attacker.connects
        window.notes.append(f"server answers {attacker.answers}; the peer held at most "
                            f"{most_held} sockets (its cap {per_peer}); /healthz "
                            f"{healthz.count(200)}/{len(healthz)} 200, {sessions} sessions "
                            "opened and served")
    assert most_held <= per_peer
    assert healthz and set(healthz) == {200}
    assert attacker.answers.get("HTTP/1.1 503", 0) + attacker.answers.get(
        "HTTP/1.1 429", 0) > 0


# 9d. a crowd at the door: half-open upgrades from 5 peers, each inside its limits ----------------
CROWD_PEERS = [f"127.0.0.{60 + k}" for k in range(5)]
CROWD_SOCKETS_PER_PEER = 120  # 600 in all, past the 200 cap; each peer under its 128
CROWD_CONNECTS_PER_S = 64  # its burst at once, then as fast as its rate lets it


def _timed_get(url: str) -> tuple[int, float]:
    """(status, seconds) of a GET; status 0: no answer within 5 s."""
    started = time.monotonic()
    try:
        status = httpx.get(url, timeout=5.0).status_code
    except httpx.HTTPError:
        status = 0
    return status, time.monotonic() - started


def test_a_crowd_of_peers_at_the_cap_leaves_the_door_open_to_clients_and_probes(world):
    attackers = [ReconnectingSlowloris(world.port, peer, CROWD_SOCKETS_PER_PEER,
                                       CROWD_CONNECTS_PER_S) for peer in CROWD_PEERS]
    threads = [threading.Thread(target=a.run, args=(ATTACK_S,)) for a in attackers]
    evicted_before = world.door_count("evicted_half_open")
    with AttackWindow(world, f"{len(CROWD_PEERS)} peers x {CROWD_SOCKETS_PER_PEER} half-open "
                      "upgrades, reopened at once (each peer inside its limits)") as window:
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # the crowd is at the cap
        most_held, sessions, tries = 0, 0, 0
        healthz, probes = [], []
        clients_refused: dict = {}
        while any(thread.is_alive() for thread in threads):
            crowd = [c for c in world.server_sockets() if c.raddr.ip in CROWD_PEERS]
            most_held = max(most_held, len(crowd))
            healthz.append(_timed_get(world.url + "/healthz"))
            probes.append(_timed_get(world.health_url + "/healthz"))
            tries += 1
            try:
                with session(world) as ws:  # a real client gets in and is served
                    ws.send(json.dumps({"type": "session.update", "session": {}}))
                    assert recv(ws)["type"] == "session.updated"
                    sessions += 1
            except (InvalidStatus, OSError) as refused:
                status = getattr(getattr(refused, "response", None), "status_code", None)
                clients_refused[status or type(refused).__name__] = clients_refused.get(
                    status or type(refused).__name__, 0) + 1
            time.sleep(0.2)
        for thread in threads:
            thread.join()
        evicted = world.door_count("evicted_half_open") - evicted_before
        answers: dict[str, int] = {}
        for attacker in attackers:
            for answer, count in attacker.answers.items():
                answers[answer] = answers.get(answer, 0) + count
        window.attempts = sum(a.connects for a in attackers)
        slowest_probe_s = max(seconds for _, seconds in probes)
        window.notes.append(
            f"the crowd held at most {most_held} sockets (cap {MAX_CONNECTIONS}), {evicted:.0f} "
            f"evicted; real clients {sessions}/{tries} in and served (refused: "
            f"{clients_refused or 'none'}); /healthz on the client "
            f"port {sum(s == 200 for s, _ in healthz)}/{len(healthz)} 200, on the health "
            f"listener {sum(s == 200 for s, _ in probes)}/{len(probes)} 200 (slowest "
            f"{slowest_probe_s * 1e3:.0f} ms); server answers {answers}")
    assert evicted > 0 and most_held >= 0.75 * MAX_CONNECTIONS  # the crowd reached the cap
    assert sessions == tries >= 10
    assert all(status == 200 for status, _ in healthz)
    assert all(status == 200 for status, _ in probes) and slowest_probe_s < 1.0


# 9e. a resume flood from 40 peers: refused before any work --------------------------------------
RESUME_PEERS = [f"127.0.1.{k}" for k in range(1, 41)]
RESUMES_PER_S = 1000  # 25/s per peer, inside each peer's 32 connections/s


class ConnectFlood(LoopbackConnections):
    """`per_s` connections a second, round-robin over `sources`, each sending `request` and
    counted by its answer's status code (or "dropped"), for `duration_s`."""

    def __init__(self, port: int, sources: list[str], request: bytes, per_s: float) -> None:
        super().__init__(port)
        self.sources, self.request, self.per_s = sources, request, per_s

    @staticmethod
    def label(data: bytes) -> str:
        return data.split(b"\r\n", 1)[0].decode(errors="replace")[9:12]  # "429"

    def run(self, duration_s: float) -> None:
        started = time.monotonic()
        while (elapsed_s := time.monotonic() - started) < duration_s:
            while self.connects < elapsed_s * self.per_s:
                self._open(self.sources[self.connects % len(self.sources)], self.request)
            self._read_answers(0.002)
        deadline = time.monotonic() + 2.0
        while self.selector.get_map() and time.monotonic() < deadline:
            self._read_answers(0.05)
        self._close_all("unanswered")


def test_a_resume_flood_is_refused_before_any_work_and_neighbours_stay_on_time(world):
    request = (f"GET /v1/realtime?metronome_events=true&resume=sess_nope HTTP/1.1\r\n"
               "Host: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
               f"Authorization: Bearer {KEY}\r\nMetronome-Resume-Token: {'x' * 43}\r\n"
               "\r\n").encode()
    flood = ConnectFlood(world.port, RESUME_PEERS, request, RESUMES_PER_S)
    refused_before = world.door_count("resume_rate")
    with AttackWindow(world, f"resume flood: {RESUMES_PER_S:,}/s wrong resumes from "
                      f"{len(RESUME_PEERS)} peers") as window:
        flood.run(ATTACK_S)
        window.attempts = flood.connects
        refused = world.door_count("resume_rate") - refused_before
        window.notes.append(f"answers {flood.answers}; {refused:.0f} refused 429 at their "
                            "headers (no token hashed)")
    assert flood.connects >= 0.9 * RESUMES_PER_S * ATTACK_S
    assert refused >= 0.9 * flood.answers.get("429", 0) > 0
    assert flood.answers.get("404", 0) <= CONFIG.resume_burst + CONFIG.resumes_per_s * (
        ATTACK_S + 2)  # what reached the token check: at most the server's resume rate


# 9c. headers past the cap in one send -----------------------------------------------------------
HEADER_SIZES_BYTES = (20_000, 100_000, 250_000)


def _ask_healthz(world: World, source: str, header_bytes: int) -> bytes:
    """GET /healthz with one header of `header_bytes`, all in one send; the status line."""
    with socket.create_connection(("127.0.0.1", world.port), **_attacker(source)) as sock:
        sock.settimeout(5)
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
                         + b"a" * header_bytes + b"\r\n\r\n")
        except OSError:
            pass  # refused before the rest
        try:
            return sock.recv(4096).split(b"\r\n", 1)[0]
        except OSError:
            return b"reset"


def test_headers_past_the_cap_in_one_send_get_431(world):
    rate_per_s = CONFIG.connections_per_s_per_peer * 0.95  # the highest the peer limit allows
    statuses: dict[tuple[int, bytes], int] = {}
    sizes_kb = "/".join(str(n // 1000) for n in HEADER_SIZES_BYTES)
    with AttackWindow(world, f"GET /healthz with a {sizes_kb} kB header in one send, "
                      f"{rate_per_s:.0f}/s from one peer") as window:
        started = time.monotonic()
        while (elapsed_s := time.monotonic() - started) < ATTACK_S:
            if window.attempts >= elapsed_s * rate_per_s:
                time.sleep(0.005)
                continue
            size = HEADER_SIZES_BYTES[window.attempts % len(HEADER_SIZES_BYTES)]
            status = _ask_healthz(world, "127.0.0.3", size)
            statuses[size, status] = statuses.get((size, status), 0) + 1
            window.attempts += 1
        window.notes.append(", ".join(f"{size // 1000} kB: {n} x {status.decode()}"
                                      for (size, status), n in sorted(statuses.items())))
    assert {status for _, status in statuses} == {
        b"HTTP/1.1 431 Request Header Fields Too Large"}
    assert _ask_healthz(world, "127.0.0.3", 1000) == b"HTTP/1.1 200 OK"  # within the cap


# 9d. every refused message echoes the client's event_id -------------------------------------
REFUSED_WITH_IDS = [  # (its event_id, the error's code, the message)
    ("evt_deep", "invalid_json", json.dumps({"type": "session.update", "event_id": "evt_deep",
                                             "session": {"a": [[[[[[[1]]]]]]]}})),
    ("evt_values", "invalid_json", json.dumps({"type": "session.update",
                                               "event_id": "evt_values",
                                               "session": {"x": list(range(600))}})),
    ("evt_syntax", "invalid_json", '{"type": "session.update", "event_id": "evt_syntax", "s'),
    ("evt_type", "unknown_event_type", '{"type": "nope", "event_id": "evt_type"}'),
    ("evt_param", "unknown_parameter",
     '{"type": "session.update", "event_id": "evt_param", "session": {"nope": 1}}'),
    ("evt_commit", "input_audio_buffer_commit_empty",
     '{"type": "input_audio_buffer.commit", "event_id": "evt_commit"}'),
]
TOO_LARGE = ('{"type": "session.update", "event_id": "evt_big", "session": {"instructions": "'
             + "x" * CONFIG.max_message_bytes + '"}}')


def test_every_refused_message_echoes_its_event_id(world):
    with AttackWindow(world, "refused messages of 7 kinds, each with an event_id, at the "
                      "message rate limit") as window, session(world) as ws:
        ws.send(TOO_LARGE)  # once: the byte rate allows about one a second
        too_large = recv(ws)["error"]
        assert (too_large["code"], too_large["event_id"]) == ("message_too_large", "evt_big")
        started = time.monotonic()
        while time.monotonic() - started < ATTACK_S:
            for event_id, code, message in REFUSED_WITH_IDS:
                ws.send(message)
                error = recv(ws)["error"]
                assert (error["code"], error["event_id"]) == (code, event_id), error
                window.attempts += 1
            time.sleep(len(REFUSED_WITH_IDS) / CONFIG.rate_limit_messages_per_s)
        window.notes.append("every error carried its message's event_id")


# ---- 10. a conversation's history in a burst ----------------------------------------------------
HISTORY_ITEMS = 50
HISTORY_WORDS = 200
HISTORY_TIMEOUT_S = 240.0  # ~20k tokens to prefill (Hamlet: ~390 a 200 words) beside the streamer


def history_items(count: int = HISTORY_ITEMS, words: int = HISTORY_WORDS) -> list[str]:
    """`count` user texts of `words` words of Hamlet each."""
    text = play_text("hamlet").split()
    return [" ".join(text[k * words:(k + 1) * words]) for k in range(count)]


async def _restore_history(world: World, items: list[str]) -> tuple[list, float]:
    """A client restoring a conversation through the official SDK: every item sent back to
    back, a question, `response.create`; (every event until response.done, the seconds it
    took to send them all)."""
    client = AsyncOpenAI(api_key=KEY, websocket_base_url=world.url.replace("http", "ws") + "/v1")
    async with client.realtime.connect(model="metronome") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                           "metronome": {"mode": "turn"}})
        started = time.monotonic()
        for text in items + ["The secret word is pineapple. What is the secret word?"]:
            await conn.conversation.item.create(item={
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": text}]})
        await conn.response.create()
        sent_s = time.monotonic() - started
        events = []
        async with asyncio.timeout(HISTORY_TIMEOUT_S):
            while (event := await conn.recv()).type != "response.done":
                events.append(event)
        return events + [event], sent_s


def test_a_history_burst_is_context_accepted_whole_and_answered(world):
    """Issue 55: 50 user items of ~200 words sent back to back (what a client restoring a
    conversation sends) are context, not frames: all accepted, prefilled as the beat allows
    beside the streamer, and the question after them answered with them in the context
    (before: every item past the 4th refused `too_many_pending_frames`)."""
    items = history_items()
    with AttackWindow(world, f"{HISTORY_ITEMS} user items of {HISTORY_WORDS} words back to "
                      "back through the official SDK, then a question") as window:
        started = time.monotonic()
        events, sent_s = asyncio.run(_restore_history(world, items))
        answered_s = time.monotonic() - started
        window.attempts = HISTORY_ITEMS + 2
        errors = [e.error for e in events if e.type == "error"]
        added = [e for e in events if e.type == "conversation.item.added"
                 and e.item.role == "user"]
        done = events[-1].response
        reply = done.output[0].content[0].text
        assert errors == [] and len(added) == HISTORY_ITEMS + 1, errors
        assert done.status == "completed" and "pineapple" in reply.lower(), (done.status, reply)
        window.notes.append(f"all {len(added)} items added, 0 errors (sent in {sent_s:.2f} s); "
                            f"the reply completed {answered_s:.0f} s later: {reply!r}")
