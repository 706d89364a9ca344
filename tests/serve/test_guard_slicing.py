"""The WebSocket guard parses a read in slices at the app's pace (`serve.edge.guard`), exactly:
one read of 32k two-byte messages (256 KiB, what uvicorn reads at once) never puts more
than one slice's messages in the app's queue, parses nothing more until the app has taken
them, and delivers every message in order. No sockets, no clock: the protocol object (after a
real handshake, to an app that accepts) over a recording transport, in one event loop."""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.server import ServerState

from metronome.serve.edge.guard import PARSE_SLICE_BYTES, GuardedWebSocketProtocol, TransportLimits
from metronome.serve.edge.peers import PeerLimits

FRAME_BYTES = 8  # a masked text frame with a 2-byte payload: 2 header, 4 mask, 2 data
ONE_READ_BYTES = 256 << 10
LIMITS = TransportLimits(request_timeout_s=5.0, max_header_bytes=8192, max_connections=10,
                         pings_per_s=100.0, ping_burst=100,
                         peers=PeerLimits(max_open=10, per_s=10.0, burst=10))


class RecordingTransport(asyncio.Transport):
    """What the protocol asks of its transport: reads paused and resumed, bytes written."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.resumes = 0
        self.written = bytearray()
        self.closing = False

    def get_extra_info(self, name, default=None):
        return default

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused, self.resumes = False, self.resumes + 1

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True


HANDSHAKE = (b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
             b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
             b"Sec-WebSocket-Version: 13\r\n\r\n")


class AcceptingApp:
    """Accepts the WebSocket, then leaves its messages to the test (which reads them with
    the protocol's own `receive`, as the app would) until `done` is set."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        await self.done.wait()


async def _open_protocol(app: AcceptingApp
                         ) -> tuple[GuardedWebSocketProtocol, RecordingTransport]:
    """A guarded protocol after its handshake (`101` sent), over a recording transport."""
    config = uvicorn.Config(app=app, ws="websockets-sansio", log_level="warning",
                            lifespan="off")
    config.load()
    protocol = GuardedWebSocketProtocol(config=config, server_state=ServerState(),
                                        app_state={}, _loop=asyncio.get_running_loop(),
                                        limits=LIMITS)
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(HANDSHAKE)
    for _ in range(20):
        await asyncio.sleep(0)
    assert protocol.handshake_complete and transport.written.startswith(b"HTTP/1.1 101")
    assert protocol.queue.qsize() == 0
    return protocol, transport


def _messages(count: int) -> bytes:
    """`count` masked text frames (mask 0) whose payloads are 2-digit numbers, mod 100."""
    return b"".join(bytes([0x81, 0x82]) + b"\0\0\0\0" + f"{i % 100:02d}".encode()
                    for i in range(count))


async def _settle() -> None:
    """Run every callback the loop holds (a slice is one `call_soon`)."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_one_read_of_tiny_messages_is_parsed_one_slice_at_a_time_at_the_apps_pace():
    async def scenario() -> None:
        app = AcceptingApp()
        protocol, transport = await _open_protocol(app)
        count = ONE_READ_BYTES // FRAME_BYTES
        per_slice = PARSE_SLICE_BYTES // FRAME_BYTES
        protocol.data_received(_messages(count))
        assert transport.paused  # the rest of the read waits; the socket is not read on
        assert protocol.queue.qsize() == 0  # parsed later, in the loop's own callbacks
        received, most_queued, slices = [], 0, 0
        while len(received) < count:
            await _settle()
            queued = protocol.queue.qsize()
            assert 0 < queued <= per_slice, (len(received), queued)
            await _settle()  # the app took nothing: nothing more is parsed
            assert protocol.queue.qsize() == queued
            most_queued, slices = max(most_queued, queued), slices + 1
            for _ in range(queued):
                received.append((await protocol.receive())["text"])
        assert received == [f"{i % 100:02d}" for i in range(count)]
        assert most_queued == per_slice and slices == count // per_slice
        await _settle()
        assert not transport.paused and transport.resumes >= 1  # read on once all parsed
        app.done.set()
        await _settle()  # the app returns

    asyncio.run(scenario())


def test_a_message_that_fits_a_slice_is_parsed_at_once():
    async def scenario() -> None:
        app = AcceptingApp()
        protocol, transport = await _open_protocol(app)
        protocol.data_received(_messages(3))
        assert protocol.queue.qsize() == 3  # (uvicorn pauses reading while it holds them)
        assert [(await protocol.receive())["text"] for _ in range(3)] == ["00", "01", "02"]
        assert not transport.paused
        app.done.set()
        await _settle()  # the app returns

    asyncio.run(scenario())
