"""Leases never leak: over random sequences of sessions streaming audio, dropping, resuming,
expiring and ending (the server state driven directly, a tiny random model), every session
ends up gone, every block back in the pool and no grant or lease left; and the event stream
that carries a resumed session's missed events keeps its bounds and its order."""

from __future__ import annotations

import asyncio
import base64

from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.engine.engine import Engine
from metronome.serve import protocol as p
from metronome.serve.config import ServerConfig
from metronome.serve.realtime.emitter import EventLog as EventStream
from metronome.serve.realtime.session import RealtimeSession
from metronome.serve.resume.resumer import ResumeRefused
from metronome.serve.serving import Serving
from tests.serve.session_client import RecordingClient
from tests.served import TEXT_DUPLEX

GRACE_S = 0.05
CONFIG = ServerConfig(**TEXT_DUPLEX, policy="sinks_window:4:64", pool_tokens=4096, admission="off",
                      sample_rates_hz=(16000,), default_sample_rate_hz=16000,
                      resume_grace_s=GRACE_S)
AUDIO = p.InputAudioBufferAppend(type="input_audio_buffer.append",
                                 audio=base64.b64encode(b"\x10\x00" * 16000).decode())


class Owner:
    """A connection, as the server sees it."""

    api_key = ""

    def __init__(self, session: RealtimeSession | None = None) -> None:
        self.session = session
        self.gone = False

    def end(self, outcome, code, reason, error=None, flush=True) -> None:
        self.gone = True

    def resume_from(self) -> int:
        return self.session.channel.log.next_seq


OPS = st.lists(st.tuples(st.sampled_from(["open", "audio", "drop", "resume", "wait", "end"]),
                         st.integers(0, 3)), min_size=1, max_size=14)


async def _play(tiny_model, ops: list[tuple[str, int]]) -> None:
    state = Serving(CONFIG, Engine(tiny_model, CONFIG.engine_config()), None, None, "tiny")
    try:
        sessions: list[tuple[RealtimeSession, str]] = []  # (session, its current token)
        for op, which in ops:
            live = [(s, t) for s, t in sessions if s.id in state.sessions]
            target = live[which % len(live)] if live else None
            if op == "open":
                owner = Owner()
                session = RealtimeSession(state, RecordingClient(), True)
                owner.session = session
                state.add(session, owner)
                sessions.append((session, state.resume.resumption.grant(
                    state.resume.state(session), "")))
            elif target is None:
                continue
            elif op == "audio" and target[0].channel.attached:
                target[0].handle(AUDIO)
            elif op == "drop" and target[0].channel.attached:
                state.resume.lease(target[0], target[0].channel.log.next_seq)
            elif op == "resume":
                session, token = target
                try:
                    state.resume.take_for_resume(session.id, token, Owner(session))
                except ResumeRefused:
                    continue  # expired meanwhile: refused, nothing changed
                session.channel.attach(RecordingClient(), None)
                index = next(i for i, (s, _) in enumerate(sessions) if s is session)
                sessions[index] = (session, state.resume.resumption.grant(
                    state.resume.state(session), ""))
            elif op == "wait":
                await asyncio.sleep(GRACE_S * 2)  # leases expire; frames get answered
            elif op == "end":
                state.remove(target[0], "completed")
        for session in list(state.sessions.values()):
            state.remove(session, "completed")
        assert not state.sessions  # (a session's connection is on it: gone with it)
        assert all(state.resume.grant_of(session) is None for session, _ in sessions)  # no grant
        assert state.resume.resumption.num_leased == 0
        for _ in range(200):  # the engine thread gives the blocks back, then the probe says
            if state.pool.used_blocks == 0 and not state.engine.sessions:
                break
            await asyncio.sleep(0.01)
        assert state.pool.used_blocks == 0, state.pool
        assert not state.engine.sessions and not state.beat.streams  # every stream closed
        assert state.engine.pool_stats().free_blocks == state.engine.pool_stats().num_blocks
    finally:
        state.close()


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(ops=OPS)
def test_leases_never_leak_blocks(tiny_model, ops):
    asyncio.run(asyncio.wait_for(_play(tiny_model, ops), 60))


@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=60),
       hold_at=st.one_of(st.none(), st.integers(0, 60)))
def test_the_event_stream_keeps_its_bounds_and_flags_an_owed_eviction(sizes, hold_at):
    stream = EventStream(max_events=8, max_bytes=1000)
    lost = False
    for seq, size in enumerate(sizes):
        if hold_at is not None and seq == min(hold_at, len(sizes) - 1):
            stream.hold_from = seq
        lost |= not stream.append(f"event_{seq}", "x" * size)
        assert len(stream.since(0).texts) <= 8
        assert stream.num_bytes <= max(1000, size)
    assert stream.next_seq == len(sizes)
    replay = stream.since(0)
    assert replay.missed_events == stream.first_seq
    assert [len(t) for t in replay.texts] == sizes[stream.first_seq:]
    newest = f"event_{len(sizes) - 1}"
    assert stream.seq_of(newest) == len(sizes) - 1 and stream.since(len(sizes)).texts == []
    if hold_at is not None:  # evicting an owed event is exactly what `append` reported
        assert lost == (stream.first_seq > min(hold_at, len(sizes) - 1))
