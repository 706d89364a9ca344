"""What `GET /v1/sessions` shows of one Realtime session (the server adds its connection:
connected or leased)."""

from __future__ import annotations


def summary(session, now_s: float, resident_kv_tokens: int | None) -> dict:
    """Of `session`, a `serve.session.RealtimeSession`."""
    record = session.record
    last = record.last_status
    return {
        "id": session.id, "status": "ended" if record.ended_reason else "active",
        "ended_reason": record.ended_reason or None, "mode": session.settings.mode.value,
        "policy": str(record.policy),
        "sample_rate_hz": session.settings.sample_rate_hz,
        "age_s": round(now_s - session.opened_at_s, 3),
        "engine_session_id": session.engine_session_id,
        "resident_kv_tokens": resident_kv_tokens,
        "frames_submitted": record.frames_submitted,
        "frames_answered": record.frames_answered,
        "last_frame_status": None if last is None else last.value,
        "unanswered_frames": record.unanswered_frames,
        "queued_input_tokens": record.queued_input_tokens,
    }
