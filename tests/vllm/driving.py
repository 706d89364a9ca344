"""Driving an engine through the seam step by step, without a clock (vLLM engine tests)."""

from __future__ import annotations

from metronome.engine.session import SessionSpec
from metronome.stream import Stream
from tests.steps import by_session


def drive(engine, frames, text_ids, sessions: int = 2, spec=SessionSpec()):
    """Each frame to every session, then step until idle; per session its steps."""
    sids = [engine.open_session(Stream.of(spec)) for _ in range(sessions)]
    steps = {sid: [] for sid in sids}
    for offset, n, new in frames:
        for k, sid in enumerate(sids):
            start = offset + 500 * k
            engine.submit(sid, text_ids[start:start + n], max_new_tokens=new)
        for _ in range(500):
            if not engine.has_work:
                break
            for outcome in by_session(engine.step()).values():
                steps[outcome.session_id].append(outcome)
        else:
            raise AssertionError("the engine did not go idle")
    return sids, steps


def tokens(steps):
    return {i: [t for s in rows for t in s.new_token_ids] for i, rows in enumerate(steps.values())}
