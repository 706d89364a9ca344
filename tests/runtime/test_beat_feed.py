"""The beat's feed (`FeedPolicy`) on the virtual clock: sessions that flood their own input
(text items far larger than a step's chunk, audio at 6x real time) beside real-time
streamers. Unmetered (the engine as before) the floods' prefill shares every step and the
streamers' frames go late; metered they meet every deadline, the floods still get full
chunks when nobody else waits, and every session's input reaches the engine whole, in order.
"""

from __future__ import annotations

import pytest
import torch

from metronome.engine.engine import Engine, EngineConfig
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.beat import FeedPolicy
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionProfile
from metronome.sim.cost_model import StepCostModel
from metronome.sim.recorder import RunRecorder
from metronome.sim.virtual import VirtualDriver
from metronome.stream import Frame, Stream

BLOCK = 16
# ~ SmolLM2 fp32 on the 2-core CPU with the server's own work beside it: a step of three
# decode rows and a 64-token chunk ~0.2 s (measured 0.11 s for the engine alone)
COST = StepCostModel(fixed_s=0.02, per_token_s=0.0025, per_context_token_s=0.0)
PROFILE = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=4,
                         policy=ResidencyPolicy.sinks_window(4, 64),
                         max_queued_input_tokens=4096)
STREAMERS = 3
FRAME_TOKENS = 13  # 1 s of audio at 12.5 tokens/s
FLOOD_TOKENS = 600  # a text item every 0.25 s
DURATION_S = 12.0


class RecordingEngine:
    """The engine, with every input position fed to each session kept (as its stream held
    it when it was fed)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.submitted: dict[str, list[torch.Tensor]] = {}

    def feed(self, session_id, num_tokens, max_new_tokens=0):
        session = self.inner.sessions[session_id]
        if num_tokens:
            self.submitted.setdefault(session_id, []).append(
                session.stream.read(session.fed_tokens, num_tokens).clone())
        self.inner.feed(session_id, num_tokens, max_new_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def tokens(seed: int, n: int) -> list[int]:
    return [1 + (seed * 37 + k * 11) % 90 for k in range(n)]


class Shares:
    """Per step: whether a streamer's frame was in flight, and the text flood's tokens."""

    def __init__(self) -> None:
        self.beat, self.calm, self.text = None, [], None
        self.steps: list[tuple[bool, int]] = []
        self.started_s: list[float] = []

    def on_step(self, out) -> None:  # after the beat has answered the step's frames
        due = any(self.beat.streams[s].in_flight is not None for s in self.calm)
        self.steps.append((self.due_before or due, out.input_tokens.get(self.text, 0)))
        self.started_s.append(out.started_s)
        self.due_before = due

    due_before = False


def flood_run(model, policy: FeedPolicy, streamers: int = STREAMERS, text_flood: bool = True,
              audio_flood: bool = True, quiet_until_s: float = 0.0):
    """`quiet_until_s`: the streamers send nothing before then."""
    engine = Engine(model, EngineConfig(block_size=BLOCK, pool_tokens=512 * BLOCK))
    recorder, shares = RunRecorder(), Shares()
    driver = VirtualDriver(engine, COST, Listeners.of(recorder, shares))
    beat = driver.beat
    beat.feed_policy = policy
    commands = beat.engine = RecordingEngine(beat.engine)
    calm = [f"calm-{k}" for k in range(streamers)]
    text = "text" if text_flood else None
    audio = "audio" if audio_flood else None
    for sid in [*calm, text, audio]:
        if sid is not None:
            beat.add(Stream(sid, PROFILE))
    sent: dict[str, list[list[int]]] = {sid: [] for sid in beat.streams}
    shares.beat, shares.calm, shares.text = beat, calm, text

    def submit(sid: str, ids: list[int], t: float) -> None:
        if beat.streams[sid].fits(len(ids)):
            beat.submit(Frame(sid, t), t, ids)
            sent[sid].append(ids)

    for k in range(round(DURATION_S * 60)):  # 1/60 s ticks
        t = k / 60
        driver.run_until(t)
        if k % 60 == 0 and t >= quiet_until_s:
            for n, sid in enumerate(calm):
                submit(sid, tokens(n + k, FRAME_TOKENS), t)
        if text is not None and k % 15 == 0:
            submit(text, tokens(k, FLOOD_TOKENS), t)
        if audio is not None and k % 10 == 0:
            submit(audio, tokens(k + 5, FRAME_TOKENS), t)
    driver.run_until(DURATION_S + 30)  # everything answered, every flood consumed
    return engine, beat, recorder, commands, calm, text, sent, shares


def calm_misses(recorder: RunRecorder, calm: list[str]) -> int:
    return sum(1 for r in recorder.results if r.session_id in calm and not r.deadline_met)


@pytest.fixture(scope="module")
def runs(tiny_model):
    return {metered: flood_run(tiny_model, FeedPolicy(metered=metered))
            for metered in (False, True)}


def test_streamers_beside_floods_meet_their_deadlines_only_when_metered(runs):
    _, _, before, _, calm, *_ = runs[False]
    _, _, after, _, calm_after, *_ = runs[True]
    frames = STREAMERS * round(DURATION_S)
    assert len([r for r in before.results if r.session_id in calm]) == frames
    assert len([r for r in after.results if r.session_id in calm_after]) == frames
    assert calm_misses(before, calm) >= frames // 2, "the floods no longer hurt: retune"
    assert calm_misses(after, calm_after) == 0


def test_a_flood_takes_a_fair_share_while_frames_are_due_and_full_chunks_otherwise(runs):
    *_, shares = runs[True]
    due = [n for busy, n in shares.steps if busy]
    steps = list(zip(shares.steps, shares.started_s, strict=True))
    free = [n for (busy, n), t in steps if not busy and n and t < DURATION_S]
    policy = FeedPolicy()
    # a step planned before a frame arrived may still take a chunk queued before it
    assert sum(n > policy.fair_tokens for n in due) <= round(DURATION_S) * 2
    assert max(free) == EngineConfig.max_chunk_tokens  # while the streamers are live
    # two periods after the last frames, the text flood is the only session still live
    alone = [n for (_, n), t in steps if t > DURATION_S + 2.0]
    assert max(alone) == EngineConfig.max_prefill_chunk_tokens
    *_, before_shares = runs[False]
    assert max(n for busy, n in before_shares.steps if busy) == EngineConfig.max_chunk_tokens


def test_every_input_reaches_the_engine_whole_in_order_and_every_frame_once(runs):
    for metered in (False, True):
        engine, beat, recorder, commands, _, _, sent, _ = runs[metered]
        for sid, frames in sent.items():
            got = torch.cat(commands.submitted[sid]).tolist()
            assert got == [t for ids in frames for t in ids], (metered, sid)
            mine = [r.index for r in recorder.results if r.session_id == sid]
            assert mine == list(range(len(frames))), (metered, sid)  # once each, in order
            stream = beat.streams[sid]
            assert stream.queued_input_tokens == 0
            assert stream.fed_tokens == stream.consumed_tokens == stream.received_tokens
            assert engine.session_tokens(sid) >= sum(map(len, frames))


def test_a_flood_alone_runs_at_the_engines_prefill_chunks(tiny_model):
    _, _, recorder, _, _, text, sent, shares = flood_run(
        tiny_model, FeedPolicy(), streamers=0, audio_flood=False)
    taken = [n for _, n in shares.steps if n]
    assert sum(taken) == sum(map(len, sent[text]))
    full = [n for n in taken if n == EngineConfig.max_prefill_chunk_tokens]
    assert len(full) >= len(taken) - len(sent[text])  # one short chunk per item at most


def test_streamers_that_speak_up_during_a_lone_flood_are_not_late(tiny_model):
    """Deadline-aware chunking: the flood runs at the engine's prefill chunks while no
    streamer is live and at a frame's chunk once one is; no streamer frame is late that
    the fixed chunk (the flood's pieces one chunk at most) met, and the flood gets further
    while it is alone."""
    runs = {alone: flood_run(tiny_model, FeedPolicy(alone_engine_tokens=alone),
                             audio_flood=False, quiet_until_s=4.0)
            for alone in (EngineConfig.max_chunk_tokens, EngineConfig.max_prefill_chunk_tokens)}
    progress = {}
    for alone, (_, _, recorder, _, calm, _, _, shares) in runs.items():
        assert len([r for r in recorder.results if r.session_id in calm]) == STREAMERS * 8
        assert calm_misses(recorder, calm) == 0, alone
        before = [n for (_, n), t in zip(shares.steps, shares.started_s, strict=True) if t < 4.0]
        live = [n for (_, n), t in zip(shares.steps, shares.started_s, strict=True)
                if 4.1 <= t < DURATION_S]
        assert max(before) == alone
        assert max(live) <= EngineConfig.max_chunk_tokens  # once a streamer is live
        progress[alone] = sum(before)
    assert progress[EngineConfig.max_prefill_chunk_tokens] > progress[
        EngineConfig.max_chunk_tokens]


def lease_attack(tiny_model, listeners: Listeners | None = None):
    """The lease attack on the virtual clock, on a host 2.5x slower than the packaged cost
    model: (its driver, the results' recorder, the sessions' profile, the 32 sessions that
    will queue text, open already)."""
    slow = StepCostModel(fixed_s=0.054 * 2.5, per_token_s=0.00126 * 2.5, per_context_token_s=0)
    engine = Engine(tiny_model, EngineConfig(block_size=BLOCK, pool_tokens=1536 * BLOCK))
    recorder = RunRecorder()
    driver = VirtualDriver(engine, slow, Listeners.of(recorder, *filter(None, [listeners])))
    profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=4,
                             policy=ResidencyPolicy.sinks_window(4, 512),
                             max_queued_input_tokens=4096)
    queued = [Stream(f"s{k}", profile) for k in range(32)]
    for stream in queued:
        driver.beat.add(stream)
    return driver, recorder, profile, queued


def queue_and_drop(driver: VirtualDriver, queued: list[Stream], from_s: float) -> None:
    """From `from_s`: each session queues ~630 tokens of text and asks for a reply, 20 ms
    apart; 0.75 s on, all their clients drop and the beat holds them."""
    for k, stream in enumerate(queued):
        at = from_s + 0.05 + 0.02 * k
        driver.run_until(at)
        driver.beat.submit(Frame(stream.id, at, respond=False), at, tokens(k, 630))
        driver.beat.submit(Frame(stream.id, at, kind="response"), at, tokens(k + 1, 3))
    driver.run_until(from_s + 0.75)
    for stream in queued:
        driver.beat.hold(stream, from_s + 0.75, "client dropped")


def test_many_sessions_ahead_share_one_chunk_beside_a_live_streamer(tiny_model):
    """The lease attack's opening (tests/serve/test_serve_attack_leases.py), on a host 2.5x
    slower than the packaged cost model's: 32 sessions each queue ~630 tokens of text and
    ask for a reply, 20 ms apart, beside a streamer whose 1 s frames are due in 1 s, and are
    held 0.7 s later (their clients dropped: `Beat.hold`, what the engine holds of theirs is
    still processed). Each took a chunk between the streamer's frames (a 1,232-token step
    at 1x: 1.6 s) and a fair share while its frame was in flight (513 tokens at 2.5x: 1.8 s),
    and its frames were late behind them; sharing one chunk, no step holds more than one
    chunk of theirs, and every frame is on time. Released, their input all reaches the
    engine."""
    steps = []
    driver, recorder, profile, queued = lease_attack(tiny_model, Listeners(
        on_step=lambda out: steps.append((out.started_s, out.input_tokens))))
    beat = driver.beat
    beat.add(Stream("streamer", profile))
    for second in range(20):
        driver.run_until(float(second))
        beat.submit(Frame("streamer", float(second)), float(second), tokens(second, FRAME_TOKENS))
        if second == 2:
            queue_and_drop(driver, queued, 2.0)
        if second == 12:
            for stream in queued:  # resumed: their input goes on to the engine
                beat.release(stream, 12.0)
    driver.run_until(120.0)
    streamed = [r for r in recorder.results if r.session_id == "streamer"]
    assert len(streamed) == 20 and all(r.deadline_met for r in streamed[:12]), [
        (r.index, round(r.latency_s, 2)) for r in streamed if not r.deadline_met]
    live = [step for started_s, step in steps if started_s < 20.0]  # (its last frame: 19 s)
    assert max(sum(n for sid, n in step.items() if sid != "streamer") for step in live
               ) <= EngineConfig.max_chunk_tokens + 1  # (+ a sampled token written back)
    # (a reply not begun when its session was held is withdrawn with its 3 tokens)
    assert all(s.consumed_tokens == s.received_tokens >= 630 for s in queued), [
        (s.consumed_tokens, s.received_tokens) for s in queued]


def test_a_streamer_that_just_opened_is_waited_for_before_its_first_frame(tiny_model):
    """The lease attack with its neighbour opened just before it (the attack test run alone):
    the streamer opens, 32 sessions queue ~630 tokens of text each within its first period,
    and its first frame arrives a period after it opened. Until a session's first frame it
    was not live, so the sessions ahead each took a chunk per step and its first two frames
    were late behind them (all 8 here, on the same 2.5x slower host as above; 2 of 8 on the
    server, in the attack test); a session that opened within `LIVE_PERIODS` periods is live:
    they share one chunk from the start."""
    driver, recorder, profile, queued = lease_attack(tiny_model)
    beat = driver.beat
    driver.run_until(1.0)
    beat.add(Stream("streamer", profile, opened_at_s=1.0))
    queue_and_drop(driver, queued, 1.0)
    for second in range(2, 10):
        driver.run_until(float(second))
        beat.submit(Frame("streamer", float(second)), float(second), tokens(second, FRAME_TOKENS))
    driver.run_until(60.0)
    streamed = [r for r in recorder.results if r.session_id == "streamer"]
    assert len(streamed) == 8 and all(r.deadline_met for r in streamed), [
        (r.index, round(r.latency_s, 2)) for r in streamed if not r.deadline_met]
