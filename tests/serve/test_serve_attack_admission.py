"""Admission under attack on a real server (the bundled SmolLM2, the wall clock), issue 23:
one client appending audio at 6x real time and one flooding text inside its queue bound,
both beside three sessions streaming speech at real time, must not steer the cap.

Their frames are late by their own input (the audio queues behind itself, each text item is
more than one step's chunk), so `admission.pacing` leaves them out of the signal: the cap
is not cut below what the well-behaved load needs (the calm sessions, the attackers' own
slots and one new user), >= 9 of 10 new users get in during the attack and after it, the
cap is back at its pre-attack value within 5 control intervals of the attackers leaving,
and a health verdict that is not ok names the attackers. (The streamers' frames stay on
time: the beat's feed gives the floods' prefill a fair share of each step while other
frames are due, `runtime.beat`'s feed; measured 0/75 late, 28/75 before the feed.) Blind to pace
and size (the old rule), the audio attacker alone cut the cap 4 -> 1 in 7.8 s and 7 of 10
users got 503.

The scenario needs a host that carries the well-behaved load: where the 3 streamers alone
take more than half their deadline before the attack (a Zen 1-class EPYC in float32: 0.60),
6 sessions' fair shares overload it, the cap is rightly cut, and the test skips and says so
(`CALM_LOAD_MAX`; it failed there with the cap cut 8 -> 3 while the floods did only 0.4-0.57
of the engine's work).

The control interval is 1 s (the default is 2 s), so the run takes ~30 s. Measured on a
2-core machine: the cap fell 8 -> 7 in the attack's first interval (the streamers' frames
slowed before any attacker frame was answered and judged), then held at 7 and was back at
8 two intervals after the attackers left (10/10 users in); with pacing disabled it fell
8 -> 1 and 4/10 got in; with pacing but without the work-share rule (the floods' prefill
took ~90 % of the engine's work and the streamers' frames 0.8-1.0 s) it fell 8 -> 4 and
6-8/10 got in.
"""

from __future__ import annotations

import base64
import json
import statistics
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from streamer import SpeechStreamer
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from metronome.admission.controller import CapSample
from metronome.load.speech import SPEECH_DIR, speech_stream
from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import with_extensions
from metronome.serve.server import ServerThread
from tests.served import TEXT_DUPLEX, recv

pytestmark = pytest.mark.model

INTERVAL_S = 1.0
RESTING_CAP = 8  # the operator's --admission-cap: where the cap starts and rests
CONFIG = ServerConfig(**TEXT_DUPLEX, pool_tokens=16384, admission="aimd", admission_cap=RESTING_CAP,
                      admission_interval_s=INTERVAL_S)
CALM_SESSIONS = 3
ATTACKERS = 2  # audio at 6x real time, and a text flood
NEEDED_CAP = CALM_SESSIONS + ATTACKERS + 1  # everyone open, and one new user
WARM_UP_S = 5.0  # intervals before the attack: the pre-attack cap
ATTACK_S = 11.0
NEW_USERS = 10
NEW_USER_EVERY_S = 2.0  # from the attack's start: 6 during it, 4 after it
RECOVERY_INTERVALS = 5
# The test's premise: this host carries the well-behaved load the cap must keep room for.
# The streamers' p95 latency before the attack, as a fraction of their deadline, scales
# about with the load: NEEDED_CAP sessions of the same work fit only if CALM_SESSIONS of
# them take at most CALM_SESSIONS / NEEDED_CAP of it. A slower host (a Zen 1-class EPYC in
# float32: 3 streamers at 0.55-0.63 of their 1 s deadline) is overloaded by the attackers'
# fair shares alone; the cap is then rightly cut, and steering cannot be told from load.
CALM_LOAD_MAX = CALM_SESSIONS / NEEDED_CAP
AUDIO_CHUNK_S = 1.0
AUDIO_EVERY_S = AUDIO_CHUNK_S / 6  # 6x real time
TEXT_EVERY_S = 0.05
FLOOD_TEXT = "the quick brown fox jumps over the lazy dog " * 70  # ~3,100 bytes, ~630 tokens


class Attacker:
    """Sends `next_message()` every `every_s` from a sender thread until stopped, whatever
    the server answers; a receiver thread keeps its frame results and error codes."""

    def __init__(self, url: str, next_message: Callable[[], str], every_s: float) -> None:
        self.ws = connect(with_extensions(url))
        assert recv(self.ws)["type"] == "session.created"
        self.next_message = next_message
        self.every_s = every_s
        self.frames: list[dict] = []
        self.error_codes: list[str] = []
        self.sent = 0
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send, daemon=True)
        self._receiver = threading.Thread(target=self._receive, daemon=True)
        self._sender.start()
        self._receiver.start()

    def _send(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set():
            self.ws.send(self.next_message())
            self.sent += 1
            self._stop.wait(max(0.0, started + self.sent * self.every_s - time.monotonic()))

    def _receive(self) -> None:
        for message in self.ws:
            event = json.loads(message)
            if event["type"] == "metronome.frame":
                self.frames.append(event["frame"])
            elif event["type"] == "error":
                self.error_codes.append(event["error"]["code"])

    @property
    def late_frames(self) -> list[dict]:
        return [f for f in self.frames if not f["deadline_met"]]

    def leave(self) -> None:
        self._stop.set()
        self._sender.join()
        self.ws.close()
        self._receiver.join(timeout=5)


def audio_chunks() -> Callable[[], str]:
    """1 s of speech per call, looped."""
    pcm = speech_stream(SPEECH_DIR, 24000, 20.0)
    chunk_bytes = round(24000 * AUDIO_CHUNK_S) * 2
    position = [0]

    def next_message() -> str:
        offset = position[0] % (len(pcm) - chunk_bytes)
        position[0] += chunk_bytes
        chunk = base64.b64encode(pcm[offset: offset + chunk_bytes]).decode()
        return json.dumps({"type": "input_audio_buffer.append", "audio": chunk})

    return next_message


def text_items() -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": FLOOD_TEXT}]}})


def new_user(url: str) -> SpeechStreamer | None:
    """A user who speaks for a second and leaves; None: refused (HTTP 503)."""
    try:
        user = SpeechStreamer(url, seconds=1.0)
    except InvalidStatus as refused:
        assert refused.response.status_code == 503
        return None
    user.start()
    return user


def sleep_until(at_s: float) -> None:
    time.sleep(max(0.0, at_s - time.monotonic()))


def test_clients_faster_than_real_time_do_not_steer_the_cap(smollm2):
    with ServerThread(CONFIG, smollm2, load_tokenizer()) as server:
        state = server.app.state.serving
        calm = [SpeechStreamer(server.ws_url, seconds=60.0) for _ in range(CALM_SESSIONS)]
        for streamer in calm:
            streamer.start()
        time.sleep(WARM_UP_S)
        pre_attack_cap = state.controller.limit.cap
        calm_load = calm_latency_fraction(state.controller.history)
        print(f"streamers' load before the attack: {calm_load:.2f} of their deadline")
        if calm_load > CALM_LOAD_MAX:
            for streamer in calm:
                streamer.stop()
            pytest.skip(f"this host is too slow for the scenario: {CALM_SESSIONS} streamers "
                        f"alone take {calm_load:.2f} of their deadline (p95, median over "
                        f"the warm-up's intervals), so {NEEDED_CAP} sessions' fair shares "
                        f"overload it and a cut cap is the right answer, not steering "
                        f"(the premise: at most {CALM_LOAD_MAX:.2f})")
        attack_at_s = state.now_s()
        attackers = [Attacker(server.ws_url, audio_chunks(), AUDIO_EVERY_S),
                     Attacker(server.ws_url, text_items, TEXT_EVERY_S)]
        started = time.monotonic()
        joined: list[bool] = []
        healths: list[dict] = []
        user: SpeechStreamer | None = None
        left_at_s = None
        for k in range(NEW_USERS):
            sleep_until(started + k * NEW_USER_EVERY_S)
            if left_at_s is None and time.monotonic() - started >= ATTACK_S:
                left_at_s = leave(attackers, state)
            if left_at_s is None:
                healths.append(httpx.get(server.url + "/healthz").json())
            if user is not None:
                user.stop()
            user = new_user(server.ws_url)
            joined.append(user is not None)
        sleep_until(started + NEW_USERS * NEW_USER_EVERY_S)
        if user is not None:
            user.stop()
        for streamer in calm:
            streamer.stop()
        history = list(state.controller.history)
    report(history, attack_at_s, left_at_s, pre_attack_cap, joined, attackers, calm, healths)

    during = [s for s in history if attack_at_s < s.at_s <= left_at_s]
    after = [s for s in history if s.at_s > left_at_s]
    assert pre_attack_cap >= NEEDED_CAP
    assert min(s.cap for s in during + after) >= NEEDED_CAP, [s.cap for s in history]
    assert sum(joined) >= 9, joined
    assert any(s.cap >= pre_attack_cap for s in after[:RECOVERY_INTERVALS]), after
    audio, text = attackers
    assert len(audio.late_frames) >= 10, audio.frames  # the attack landed: its frames late
    assert "input_audio_buffer_overflow" in audio.error_codes  # ... up to its buffer bound
    # (how many of its huge items are answered in the window follows the host's speed: 5
    # then 4 of 241 at the same commit on a busier host; the rest are refused)
    assert len(text.frames) >= 3 and "too_many_pending_frames" in text.error_codes
    assert sum(s.self_paced for s in during) >= 10  # ... and was left out of the signal
    # if the streamers' frames do go late (a slow machine), health may say so, and then
    # names who overloads itself
    hurt = [h["reason"] for h in healths if h["status"] != "ok"]
    assert all("overload themselves" in r or "overloads itself" in r for r in hurt), hurt


def calm_latency_fraction(history: list[CapSample]) -> float:
    """The warm-up's load: the median over its intervals with frames of their p95 latency /
    deadline (the first interval left out: it holds the sessions' first frames)."""
    fractions = [s.latency_fraction for s in history[1:] if s.latency_fraction is not None]
    assert fractions, "no streamer frame answered in the warm-up"
    return statistics.median(fractions)


def leave(attackers: list[Attacker], state) -> float:
    for attacker in attackers:
        attacker.leave()
    return state.now_s()


def report(history: list[CapSample], attack_at_s: float, left_at_s: float,
           pre_attack_cap: int, joined: list[bool], attackers: list[Attacker],
           calm: list[SpeechStreamer], healths: list[dict]) -> None:
    def caps(first_s: float, last_s: float) -> list[int]:
        return [s.cap for s in history if first_s < s.at_s <= last_s]

    audio, text = attackers
    calm_frames = [f for s in calm for f in s.frames]
    calm_late = sum(len(s.late_frames) for s in calm)
    print(f"cap before the attack {pre_attack_cap}; during it "
          f"{caps(attack_at_s, left_at_s)}; after it {caps(left_at_s, float('inf'))}")
    intervals = [(s.cap, s.active_sessions, s.frames,
                  s.latency_fraction and round(s.latency_fraction, 2), s.misses, s.output_gaps,
                  s.self_paced, s.self_paced_work_share and round(s.self_paced_work_share, 2),
                  s.steered)
                 for s in history]
    print(f"per interval (cap, active, frames, p95 latency / deadline, misses, output gaps, "
          f"self-paced, their work share, steered): {intervals}")
    print(f"new users admitted {sum(joined)}/{len(joined)}: {joined}")
    print(f"audio attacker: {audio.sent} chunks sent, {len(audio.frames)} frames answered, "
          f"{len(audio.late_frames)} late, {audio.error_codes.count('input_audio_buffer_overflow')}"
          f" refused; text flood: {text.sent} items sent, {len(text.frames)} frames, "
          f"{len(text.late_frames)} late, {text.error_codes.count('too_many_pending_frames')} "
          f"refused; calm: {len(calm_frames)} frames, {calm_late} late")
    print(f"calm frames' latency before, during and after the attack (ms): "
          f"{[[round(f['latency_ms']) for f in s.frames] for s in calm]}")
    print(f"health during the attack: {[(h['status'], h['reason']) for h in healths]}")
