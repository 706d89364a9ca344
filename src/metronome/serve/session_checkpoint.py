"""A Realtime session's own state as JSON, for its checkpoint (`serve.checkpoint`), and back.

Everything a server needs, beside the engine session's snapshot, to go on with a session
another server held: its settings, conversation items, frame numbering (and KV bound, if
pressure imposed one), event numbering, audio framing and the encoder's stream context,
the text decoder's held tokens, instructions. Taken only while the session is quiescent
(`RealtimeSession.quiescent`: no frame or input under way), so nothing in flight is lost
by leaving it out. Server VAD is not carried: it listens afresh from the restored position.
"""

from __future__ import annotations

from metronome.serve.conversation import Conversation


def saved_state(session) -> dict:
    """`session` (a `serve.session.RealtimeSession`, quiescent) as JSON."""
    assert session.quiescent
    record = session.record
    return {
        "id": session.id, "extensions": session.extensions,
        "settings": session.settings.saved(),
        "age_s": session.host.now_s() - session.opened_at_s, "started": session.started,
        "frames_submitted": record.frames_submitted,
        "bound": None if record.bound is None else str(record.bound),
        "next_event_seq": session.channel.stream.next_seq,
        "conversation": session.conversation.saved(), "framer": session.framer.saved(),
        "committed_ms": session.committed_ms,
        "appended_since_commit_bytes": session.appended_since_commit_bytes,
        "decoder_held_ids": [] if session.decoder is None else session.decoder.held_ids,
        "instructions": session.instructions,
        "told_not_honored": sorted(session.told_not_honored),
        "last_client_event_id": session.last_client_event_id,
    }


def load_state(session, saved: dict) -> None:
    """Onto a session just built from `saved` (its id, settings and engine session set)."""
    session.started = saved["started"]
    session.channel.stream.next_seq = saved["next_event_seq"]
    session.conversation = Conversation.load(saved["conversation"])
    session.framer.load(saved["framer"])
    session.committed_ms = saved["committed_ms"]
    session.appended_since_commit_bytes = saved["appended_since_commit_bytes"]
    if session.decoder is not None:
        session.decoder.hold(saved["decoder_held_ids"])
    session.instructions = saved["instructions"]
    session.told_not_honored = set(saved["told_not_honored"])
    session.last_client_event_id = saved.get("last_client_event_id")  # older checkpoints: none
    session.set_turns(session.settings.turns)  # server VAD listens afresh from here
