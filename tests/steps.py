"""Reading one session's part of an engine step in tests: `outcome(out, sid)`."""

from __future__ import annotations

from types import SimpleNamespace

from metronome.engine.types import StepOutput


def outcome(out: StepOutput, session_id: str) -> SimpleNamespace:
    """Session `session_id`'s part of step `out` (it must have had work in it)."""
    return SimpleNamespace(
        session_id=session_id, status=out.status[session_id],
        input_tokens=out.input_tokens.get(session_id, 0),
        consumed_tokens=out.consumed_tokens.get(session_id, 0),
        new_token_ids=out.new_token_ids.get(session_id, []),
        generating=session_id in out.generating, logits=out.logits.get(session_id),
        context_tokens=out.context_tokens.get(session_id, 0))


def by_session(out: StepOutput) -> dict[str, SimpleNamespace]:
    """Every session's part of step `out`, in step order."""
    return {sid: outcome(out, sid) for sid in out.status}
