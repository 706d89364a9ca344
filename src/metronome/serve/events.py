"""What a frame's result becomes on the wire: the server events rendered from the runtime's
`FrameResult` and the server's `FrameOrigin` (what the frame belongs to).

A frame that asked for output is one response: its text (`response.output_text.delta`, if
any), its `metronome.frame`, then `response.done` with the response's status, from the
frame's (ok: completed; late: incomplete, "deadline"; cancelled: cancelled, "session_closed"
or `turn_detected`; any other: failed, the frame's status as the error code). A frame
without output (turn-mode prefill) is its `metronome.frame` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from metronome.runtime.frame import FrameResult, FrameStatus
from metronome.serve import protocol as p

FrameKind = Literal["audio", "text", "response"]
TURN_DETECTED = "turn_detected"  # a response cancelled because the user spoke (OpenAI's)


@dataclass(frozen=True)
class FrameOrigin:
    """What a frame belongs to, for the events its result becomes (kept by the session,
    by frame index: the runtime's `Frame` carries none of it)."""

    kind: FrameKind
    num_input_tokens: int
    response_id: str | None  # None: no output asked for (turn-mode prefill)
    output_item_id: str | None
    audio_end_ms: float | None


_RESPONSE_STATUS = {  # frame status -> (response status, reason)
    FrameStatus.OK: ("completed", None),
    FrameStatus.LATE: ("incomplete", "deadline"),
    FrameStatus.CANCELLED: ("cancelled", "session_closed"),  # unless TURN_DETECTED
}


def result_events(result: FrameResult, origin: FrameOrigin, text: str) -> list[p.ServerEvent]:
    """The events of one frame's result, in the order they go out; `text`: its output,
    decoded."""
    events: list[p.ServerEvent] = []
    if origin.response_id is not None and text:
        events.append(p.ResponseOutputTextDelta(response_id=origin.response_id,
                                                item_id=origin.output_item_id, delta=text))
    events.append(p.MetronomeFrame(response_id=origin.response_id,
                                   frame=_frame_out(result, origin)))
    if origin.response_id is not None:
        events.append(p.ResponseDone(response=_response_out(result, origin, text)))
    return events


def response_created(response_id: str) -> p.ResponseCreated:
    return p.ResponseCreated(response=p.ResponseOut(id=response_id, status="in_progress"))


def _frame_out(result: FrameResult, origin: FrameOrigin) -> p.FrameOut:
    return p.FrameOut(
        index=result.index, kind=origin.kind, status=result.status.value, reason=result.reason,
        num_input_tokens=origin.num_input_tokens, num_tokens=len(result.token_ids),
        arrival_s=result.arrival_s, start_s=result.start_s, finish_s=result.finish_s,
        deadline_at_s=result.deadline_at_s, latency_ms=result.latency_s * 1e3,
        deadline_met=result.deadline_met, good=result.good, audio_end_ms=origin.audio_end_ms,
    )


def _response_out(result: FrameResult, origin: FrameOrigin, text: str) -> p.ResponseOut:
    status, reason = _RESPONSE_STATUS.get(result.status, ("failed", None))
    if result.status is FrameStatus.CANCELLED and result.reason == TURN_DETECTED:
        reason = TURN_DETECTED
    error = None
    if status == "failed":
        error = {"type": p.ErrorType.SERVER.value, "code": result.status.value,
                 "message": result.reason}
    item = p.ItemOut(id=origin.output_item_id, role="assistant",
                     status="completed" if status == "completed" else "incomplete",
                     content=[p.ContentOut(type="output_text", text=text)])
    num_output = len(result.token_ids)
    return p.ResponseOut(
        id=origin.response_id, status=status,
        status_details=p.StatusDetails(type=status, reason=reason, error=error),
        output=[item],
        usage=p.Usage(total_tokens=origin.num_input_tokens + num_output,
                      input_tokens=origin.num_input_tokens, output_tokens=num_output),
    )
