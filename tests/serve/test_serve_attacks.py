"""Attacks on `metronome serve` (a subprocess on 127.0.0.1, with an API key): lone UTF-16
surrogates, messages that are costly to validate, message floods, a client that never
reads, slowloris, and the key's surface. A well-behaved session streams speech beside them
the whole time: it keeps >= 99 % of its frames on time, and the server's resident memory
(VmRSS in /proc/<pid>/status) stays within RSS_BOUND_MB of where it was when they began.
That verdict is the server fixture's, given when it ends, over whichever attacks ran (all
of them, in any order, or one), so no test depends on another having run before it."""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import psutil
import pytest
from served import SHARED_CPU_ENV, served
from streamer import SpeechStreamer, recv
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from metronome.serve.config import ServerConfig

pytestmark = pytest.mark.model
KEY = "sk-attack-test"
BEARER = {"Authorization": f"Bearer {KEY}"}
BROWSER = ["realtime", f"openai-insecure-api-key.{KEY}"]  # what OpenAI's browser clients send
REQUEST_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 200
CONFIG = ServerConfig(pool_tokens=4096, admission="off", api_key=KEY,
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

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws", 1) + "/v1/realtime"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def health(self) -> dict:
        return httpx.get(self.url + "/healthz", headers=BEARER).json()

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
    with served(CONFIG, SHARED_CPU_ENV) as url:
        pid = server_pid(int(url.rsplit(":", 1)[1]))
        streamer = SpeechStreamer(url.replace("http", "ws", 1) + "/v1/realtime",
                                  additional_headers=BEARER)
        streamer.start()
        rss = RssSampler(pid).start()
        yield World(url, pid, streamer, rss)
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
COSTLY = [  # each under the 1 MiB message cap; ~1 s to validate and ~140 ms to parse before
    json.dumps({"type": "session.update", "session": {"output_modalities": ["x"] * 200_000}},
               separators=(",", ":")),
    '{"type":"session.update","session":{"x":[' + "[]," * 300_000 + "[]]}}",
]


def test_costly_messages_are_refused_in_milliseconds(world):
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


ONE_READ = {  # 256 KiB each, what the server reads at once: ~0.2-0.3 s to parse whole
    "2-byte messages": bytes([0x81, 0x82]) + b"\0\0\0\0{}",
    "pings": bytes([0x89, 0x80]) + b"\0\0\0\0",
    "1-byte fragments": bytes([0x00, 0x81]) + b"\0\0\0\0x",
}


def test_one_read_of_tiny_frames_does_not_stall_the_loop(world):
    probe = RoundTrips(world)
    time.sleep(0.3)
    calm_s = max(probe.rtts_s)
    for name, frame in ONE_READ.items():
        sock = _raw_websocket(world, receive_buffer_bytes=1 << 16)
        start = bytes([0x01, 0x81]) + b"\0\0\0\0x" if name == "1-byte fragments" else b""
        sock.sendall(start + frame * ((256 << 10) // len(frame)))
        time.sleep(0.5)
        sock.close()
    probe.stop()
    worst_s = max(probe.rtts_s)
    print(f"one read of tiny frames: round trips at most {worst_s * 1e3:.0f} ms "
          f"(calm: {calm_s * 1e3:.0f} ms)")
    assert worst_s < 0.1


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
    selector = selectors.DefaultSelector()
    opened_at: dict[socket.socket, float] = {}
    for _ in range(SLOWLORIS_SOCKETS):
        sock = socket.create_connection(("127.0.0.1", world.port))
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
    assert held == 0, f"{held} of {SLOWLORIS_SOCKETS} sockets still open"
    assert max(closed_after_s.values()) < REQUEST_TIMEOUT_S + 1.0
    assert most_held <= MAX_CONNECTIONS
    assert refused >= SLOWLORIS_SOCKETS - MAX_CONNECTIONS
    assert httpx.get(world.url + "/healthz").status_code == 200  # and it serves again
    print(f"slowloris: {refused} refused 503, the rest dropped within "
          f"{max(closed_after_s.values()):.2f} s; server held at most {most_held}")


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
