"""Hostile input: over 1,000 malformed or hostile messages across sessions (a corpus plus
hypothesis-generated ones). Each is answered by an `error` event or a clean close, every
hostile session stays consistent, nothing crashes, and a well-behaved session streaming
speech alongside the whole time meets every deadline: that verdict is the server fixture's,
given when it ends, over whichever tests ran (all, in any order, or one), so no test
depends on another having run before it."""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from served import SHARED_CPU_ENV, served
from streamer import SpeechStreamer, recv
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from metronome.load.speech import SPEECH_DIR, speech_stream
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import with_extensions
from tests.served import TEXT_DUPLEX

pytestmark = pytest.mark.model
AUDIO_DIR = SPEECH_DIR
# Deadlines at 1.5 frame periods: the streamer shares engine steps with the test's own
# turn reply, and on a slow CI machine (fp32) that put a frame at 1.00 s of a 1 s deadline
# with no hostility involved. Stalls from hostile input were 0.9-2.9 s: still caught.
# The per-peer connection rate is raised out of the way: the generated test opens ~100
# connections from one address in 1-3 s (two per example), which the default 32/s with a
# burst of 64 refuses with HTTP 429 whenever the machine answers fast. That limit is tested
# in tests/serve/test_serve_attacks; here every connect must get through.
CONFIG = ServerConfig(**TEXT_DUPLEX, pool_tokens=4096, admission="off", max_message_bytes=16384,
                      max_text_chars=2000, max_buffered_audio_s=3.0, deadline_fraction=1.5,
                      connections_per_s_per_peer=10_000.0, connection_burst_per_peer=10_000)
TRANSPORT_CLOSE = 1009  # over the transport cap (4 x 16 KiB): closed before it reaches us
MIN_MESSAGES = 1000


class HostileSession:
    def __init__(self, url: str) -> None:
        self.url = url
        self.ws = None

    def exchange(self, message: str | bytes) -> str:
        """Send one message; its answer: an error code, or `close:<code>`."""
        if self.ws is None:
            self.ws = connect(with_extensions(self.url), max_size=None)
            assert recv(self.ws)["type"] == "session.created"
        self.ws.send(message)
        try:
            while True:
                event = recv(self.ws)
                if event["type"] == "error":
                    return event["error"]["code"]
        except ConnectionClosed as closed:
            self.ws = None
            return f"close:{closed.rcvd.code if closed.rcvd else None}"

    def assert_consistent(self) -> None:
        """The session still answers, with its settings untouched."""
        if self.ws is None:
            return
        self.ws.send(json.dumps({"type": "session.update", "session": {}}))
        event = recv(self.ws)
        while event["type"] != "session.updated":  # the answers to a flood, then it
            assert event["type"] != "error", event
            event = recv(self.ws)
        assert event["session"]["metronome"]["mode"] == "duplex"
        assert event["session"]["audio"]["input"]["format"]["rate"] == 24000

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()


@dataclass(frozen=True)
class Server:
    url: str

    @property
    def ws_url(self) -> str:
        return self.url.replace("http", "ws", 1) + "/v1/realtime"


@pytest.fixture(scope="module")
def world():
    # A separate process, as deployed: the hostile clients' own Python work here must not
    # take the server's GIL, or the streamer's lateness would measure this test, not us.
    with served(CONFIG, SHARED_CPU_ENV) as url:
        server = Server(url)
        streamer = SpeechStreamer(server.ws_url)
        streamer.start()
        yield server, streamer
        streamer_met_every_deadline(streamer)


def streamer_met_every_deadline(streamer: SpeechStreamer) -> None:
    """The verdict over the tests that ran: every frame the streamer sent (6 at least) was
    answered on time, without an error."""
    while streamer.sent_bytes < 6 * 48000:  # at least 6 frames, all during the hostility
        time.sleep(0.1)
    sent_frames = streamer.stop()
    assert len(streamer.frames) == sent_frames
    assert streamer.errors == []
    late = [f for f in streamer.frames if f["status"] != "ok" or not f["deadline_met"]]
    assert late == [], late
    print(f"streamer frames {sent_frames}, latency ms max "
          f"{max(f['latency_ms'] for f in streamer.frames):.0f}")


def play(world, messages: list[str | bytes], num_sessions: int = 3) -> list[str]:
    """Each message's answer (an error code or `close:<code>`), over `num_sessions`
    sessions, each checked consistent afterwards."""
    server, _ = world
    sessions = [HostileSession(server.ws_url) for _ in range(num_sessions)]
    try:
        answers = [sessions[i % num_sessions].exchange(m) for i, m in enumerate(messages)]
        for session in sessions:
            session.assert_consistent()
    finally:  # a failing example must not leave its sessions open for the next test
        for session in sessions:
            session.close()
    return answers


# ---- the corpus ------------------------------------------------------------------------------
def _event(**fields) -> str:
    return json.dumps(fields)


def _session(session) -> str:
    return _event(type="session.update", session=session)


def _pcm_format(**fmt) -> dict:
    return {"audio": {"input": {"format": {"type": "audio/pcm"} | fmt}}}


def _item(**item) -> str:
    return _event(type="conversation.item.create", item={"type": "message", "role": "user",
                                                         "content": [{"type": "input_text",
                                                                      "text": "hi"}]} | item)


CORPUS: list[tuple[str | bytes, str]] = [
    # not JSON, or not an object
    ("", "invalid_json"), (" ", "invalid_json"), ("{", "invalid_json"), ("}", "invalid_json"),
    ("nul", "invalid_json"), ("\x00", "invalid_json"), ("{'type': 'x'}", "invalid_json"),
    ('{"type": "session.update",}', "invalid_json"), ("[]", "invalid_json"),
    ("null", "invalid_json"), ("true", "invalid_json"), ("42", "invalid_json"),
    ("NaN", "invalid_json"), ("1e999999", "invalid_json"), ('"session.update"', "invalid_json"),
    ("[" * 10000, "invalid_json"), ('{"a":' * 3000, "invalid_json"),
    # the event type
    ("{}", "unknown_event_type"), ('{"type": null}', "unknown_event_type"),
    ('{"type": 1}', "unknown_event_type"), ('{"type": []}', "unknown_event_type"),
    ('{"type": {}}', "unknown_event_type"), ('{"type": "SESSION.UPDATE"}', "unknown_event_type"),
    ('{"type": "session.update "}', "unknown_event_type"),
    ('{"type": "response.cancel"}', "response_cancel_not_active"),
    ('{"type": "response.frobnicate"}', "unknown_event_type"),
    (_event(type="x" * 5000), "unknown_event_type"),
    # session.update
    ('{"type": "session.update"}', "missing_required_parameter"),
    (_session(None), "invalid_value"), (_session([]), "invalid_value"),
    (_session({"voice": "alloy"}), "unknown_parameter"),
    (_session({"instructions": 7}), "invalid_value"),
    (_session({"instructions": "x" * 2001}), "text_too_long"),
    (_session({"audio": {"input": {"turn_detection": {"type": "vad_of_the_future"}}}}),
     "invalid_value"),
    (_session({"audio": {"input": {"turn_detection": {"type": "server_vad",
                                                      "threshold": 2}}}}), "invalid_value"),
    (_session({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}), "unsupported"),
    (_session({"audio": {"input": {"format": {"type": "audio/pcma"}}}}), "unsupported"),
    (_session(_pcm_format(rate="24000")), "invalid_value"),
    (_session(_pcm_format(rate=24000.5)), "invalid_value"),
    (_session(_pcm_format(rate=-1)), "unsupported_sample_rate"),
    (_session(_pcm_format(rate=10**30)), "unsupported_sample_rate"),
    (_session(_pcm_format(rate=8000)), "unsupported_sample_rate"),
    (_session({"output_modalities": ["video"]}), "invalid_value"),
    (_session({"metronome": {"mode": "simplex"}}), "invalid_value"),
    (_session({"metronome": {"frame_period_s": 0.001}}), "unknown_parameter"),
    (_event(type="session.update", event_id="e" * 200, session={}), "invalid_value"),
    (_event(type="session.update", event_id=7, session={}), "invalid_value"),
    # input_audio_buffer.append
    ('{"type": "input_audio_buffer.append"}', "missing_required_parameter"),
    (_event(type="input_audio_buffer.append", audio=None), "invalid_value"),
    (_event(type="input_audio_buffer.append", audio=[1, 2]), "invalid_value"),
    (_event(type="input_audio_buffer.append", audio="!!!!"), "invalid_audio"),
    (_event(type="input_audio_buffer.append", audio="abc"), "invalid_audio"),
    (_event(type="input_audio_buffer.append", audio="AA=="), "invalid_audio"),  # one byte
    (_event(type="input_audio_buffer.append", audio=""), "invalid_audio"),
    (_event(type="input_audio_buffer.append", audio="é"), "invalid_audio"),
    (_event(type="input_audio_buffer.append", audio="AA AA"), "invalid_audio"),
    (_event(type="input_audio_buffer.append", audio="AAAA", x=1), "unknown_parameter"),
    # input_audio_buffer.commit: nothing was appended
    ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty"),
    ('{"type": "input_audio_buffer.commit", "item_id": "i"}', "unknown_parameter"),
    # conversation.item.create
    ('{"type": "conversation.item.create"}', "missing_required_parameter"),
    (_item(role="assistant"), "unsupported"), (_item(content=[]), "invalid_value"),
    (_item(role="developer"), "invalid_value"),
    (_item(content=[{"type": "input_audio", "audio": "AAAA"}]), "unsupported"),
    (_item(content=[{"type": "input_text", "text": 5}]), "invalid_value"),
    (_item(content=[{"type": "input_text", "text": "x" * 2001}]), "text_too_long"),
    (_item(content=[{"type": "input_text", "text": "x"}] * 100), "invalid_value"),
    (_item(type="function_call"), "unknown_parameter"),
    (_event(type="conversation.item.create", item={"type": "function_call_output",
                                                   "call_id": "c", "output": "{}"}),
     "unsupported"),
    (_event(type="conversation.item.create", previous_item_id="item_x",
            item={"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": "hi"}]}), "unsupported"),
    (_event(type="conversation.item.retrieve", item_id="item_x"), "item_not_found"),
    (_event(type="conversation.item.delete", item_id="item_x"), "item_not_found"),
    (_event(type="conversation.item.truncate", item_id="item_x", content_index=0,
            audio_end_ms=0), "item_not_found"),
    (_event(type="output_audio_buffer.clear"), "unsupported"),
    # response.create
    (_event(type="response.create", response={"voice": "alloy"}), "unknown_parameter"),
    (_event(type="response.create", response={"output_modalities": ["video"]}),
     "invalid_value"),
    (_event(type="response.create", response={"conversation": "none"}), "unsupported"),
    (_event(type="response.create", response=5), "invalid_value"),
    # frames and sizes
    (b"", "binary_not_supported"), (b"\x00" * 10, "binary_not_supported"),
    (b'{"type": "response.create"}', "binary_not_supported"),
    ("x" * 20000, "message_too_large"),
    (_event(type="input_audio_buffer.append", audio="A" * 30000), "message_too_large"),
    ("x" * 70000, f"close:{TRANSPORT_CLOSE}"),
]


def test_corpus_each_message_gets_its_exact_error_or_a_clean_close(world):
    messages, expected = zip(*CORPUS, strict=True)
    assert play(world, list(messages)) == list(expected)


def test_audio_flood_is_refused_past_the_buffer_and_the_session_survives(world):
    server, _ = world
    session = HostileSession(server.ws_url)
    chunk = base64.b64encode(speech_stream(AUDIO_DIR, 24000, 0.2)).decode()
    append = json.dumps({"type": "input_audio_buffer.append", "audio": chunk})
    assert session.exchange("{}") == "unknown_event_type"  # connected
    for _ in range(50):  # 10 s of audio at once; 3 s may be unanswered
        session.ws.send(append)
    session.ws.send(json.dumps({"type": "session.update", "session": {}}))
    events = []
    while not events or events[-1]["type"] != "session.updated":  # after every append
        events.append(recv(session.ws))
    errors = [e["error"]["code"] for e in events if e["type"] == "error"]
    assert set(errors) == {"input_audio_buffer_overflow"} and len(errors) >= 30
    frames = sum(e["type"] == "metronome.frame" for e in events)
    while frames < (50 - len(errors)) // 5:  # every accepted second is answered
        frames += recv(session.ws)["type"] == "metronome.frame"
    session.assert_consistent()
    session.close()


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _bad_audio(text: str) -> bool:
    try:
        pcm = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return True
    return len(pcm) % 2 == 1 or not pcm


JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(
    max_size=20)
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4) | (
    st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=16)
NOT_STRINGS = JSON_VALUES.filter(lambda v: not isinstance(v, str))
TEMPLATES = [  # (valid event, its field, values that field can never take)
    ({"type": "session.update", "session": {"type": "realtime"}}, "session", JSON_LEAVES),
    ({"type": "input_audio_buffer.append", "audio": "AAAA"}, "audio", NOT_STRINGS),
    ({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}},
     "item", JSON_LEAVES),
    ({"type": "response.create", "response": {"output_modalities": ["text"]}}, "response",
     JSON_LEAVES.filter(lambda v: v is not None)),  # response is optional: null is valid
]


@st.composite
def mutated_event(draw) -> str:
    """A valid event made invalid in one way that no server may accept."""
    template, field_name, invalid = draw(st.sampled_from(TEMPLATES))
    event = json.loads(json.dumps(template))
    how = draw(st.sampled_from(["extra", "drop", "type", "value"]))
    if how == "extra":
        event[f"x_{draw(st.text(max_size=8))}"] = draw(JSON_VALUES)
    elif how == "drop" and field_name != "response":  # the others are required
        del event[field_name]
    elif how == "type":
        event["type"] = draw(st.text(max_size=30).filter(lambda t: "." not in t))
    else:
        event[field_name] = draw(invalid)
    return json.dumps(event)


HOSTILE = st.one_of(
    st.text(max_size=300).filter(lambda t: not _is_json_object(t)),
    JSON_VALUES.map(json.dumps),
    mutated_event(),
    st.text(max_size=200).filter(_bad_audio).map(
        lambda a: json.dumps({"type": "input_audio_buffer.append", "audio": a})),
    st.integers().filter(lambda r: r not in CONFIG.sample_rates_hz).map(
        lambda r: _session(_pcm_format(rate=r))),
    st.binary(max_size=64),
)


def test_generated_hostile_messages_are_each_answered(world):
    outcomes: Counter = Counter()  # error code or close:<code>

    @settings(max_examples=50, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(messages=st.lists(HOSTILE, min_size=20, max_size=20))
    def each_answered(messages):
        answers = play(world, messages, num_sessions=2)
        assert all(not a.startswith("close:") for a in answers), answers  # all small
        outcomes.update(answers)

    each_answered()
    print(f"generated hostile messages: {outcomes.total()} {dict(outcomes)}")
    assert outcomes.total() >= MIN_MESSAGES, outcomes


def test_abrupt_disconnects_leave_nothing_behind(world):
    server, _ = world
    for _ in range(10):
        ws = connect(server.ws_url)
        ws.send('{"type": "input_audio_buffer.append", "audio": "AAAA"}')
        ws.socket.close()  # no close frame: the TCP connection just goes
    deadline = time.monotonic() + 5
    while httpx.get(server.url + "/healthz").json()["sessions"] > 1:  # the streamer remains
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_the_server_stays_whole_a_fresh_session_gets_a_full_correct_reply(world):
    server, _ = world
    with connect(server.ws_url) as ws:
        recv(ws)
        ws.send(_item(content=[{"type": "input_text", "text": "What is the capital of France?"}]))
        ws.send('{"type": "response.create"}')
        events = [recv(ws, 30.0)]
        while events[-1]["type"] != "response.done":
            events.append(recv(ws, 30.0))
        done = events[-1]
    assert done["response"]["status"] == "completed"
