"""What a response and a frame's result become on the wire: server events rendered from the
runtime's `FrameResult` and the server's `FrameOrigin` (what the frame belongs to).

A frame that asked for output is one response. It opens (`response_opened`) when it is
created: `response.created`, its assistant item added (`response.output_item.added`,
`conversation.item.added`) and its text part (`response.content_part.added`). When the beat
answers its frame it closes (`result_events`): its text (`response.output_text.delta`, if
any, then `.done`), the part, the item (`response.output_item.done`,
`conversation.item.done`) and `response.done` with the response's status, from the frame's
(ok: completed; late: incomplete; cancelled: cancelled, with `turn_detected` or
`client_cancelled` when one of those cancelled it; any other: failed, the frame's status as
the error code). `metronome.frame` (the frame's status and server-side timing) goes in
between, to a client that opted in. A frame without output (turn-mode prefill) is its
`metronome.frame` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from metronome.runtime.frame import FrameResult, FrameStatus
from metronome.serve import protocol as p
from metronome.serve.protocol import server as se

FrameKind = Literal["audio", "text", "response"]
TURN_DETECTED = "turn_detected"  # a response cancelled because the user spoke (OpenAI's)
CLIENT_CANCELLED = "client_cancelled"  # a response cancelled by `response.cancel` (OpenAI's)


@dataclass(frozen=True)
class ResponseHandle:
    """A response's ids, fixed when it opens."""

    response_id: str
    item_id: str  # its assistant item
    previous_item_id: str | None  # the conversation's last item when it opened
    metadata: dict[str, str] | None = None


@dataclass(frozen=True)
class FrameOrigin:
    """What a frame belongs to, for the events its result becomes (kept by the session,
    by frame index: the runtime's `Frame` carries none of it)."""

    kind: FrameKind
    num_input_tokens: int
    response: ResponseHandle | None  # None: no output asked for (turn-mode prefill)
    audio_end_ms: float | None


_RESPONSE_STATUS = {  # frame status -> response status
    FrameStatus.OK: "completed",
    FrameStatus.LATE: "incomplete",
    FrameStatus.CANCELLED: "cancelled",
}


def response_opened(response: ResponseHandle) -> list[p.ServerEvent]:
    item = assistant_item(response, "in_progress", None)
    return [
        se.ResponseCreated(response=se.ResponseOut(id=response.response_id,
                                                   status="in_progress",
                                                   metadata=response.metadata)),
        se.ResponseOutputItemAdded(response_id=response.response_id, item=item),
        se.ConversationItemAdded(previous_item_id=response.previous_item_id, item=item),
        se.ResponseContentPartAdded(response_id=response.response_id, item_id=response.item_id,
                                    part=se.PartOut()),
    ]


def result_events(result: FrameResult, origin: FrameOrigin, text: str,
                  extensions: bool) -> list[p.ServerEvent]:
    """The events of one frame's result, in the order they go out; `text`: its output,
    decoded; `extensions`: the client opted in to `metronome.*` events."""
    events: list[p.ServerEvent] = []
    response = origin.response
    if response is not None and text:
        events.append(se.ResponseOutputTextDelta(response_id=response.response_id,
                                                 item_id=response.item_id, delta=text))
    if extensions:
        events.append(se.MetronomeFrame(
            response_id=response.response_id if response else None,
            frame=_frame_out(result, origin)))
    if response is None:
        return events
    status = _RESPONSE_STATUS.get(result.status, "failed")
    item = assistant_item(response, "completed" if status == "completed" else "incomplete", text)
    rid, item_id = response.response_id, response.item_id
    events += [
        se.ResponseOutputTextDone(response_id=rid, item_id=item_id, text=text),
        se.ResponseContentPartDone(response_id=rid, item_id=item_id, part=se.PartOut(text=text)),
        se.ResponseOutputItemDone(response_id=rid, item=item),
        se.ConversationItemDone(previous_item_id=response.previous_item_id, item=item),
        se.ResponseDone(response=_response_out(result, origin, status, item)),
    ]
    return events


def assistant_item(response: ResponseHandle, status: str, text: str | None) -> se.ItemOut:
    """A response's output item; `text` None: no content yet (in progress)."""
    content = [] if text is None else [se.ContentOut(type="output_text", text=text)]
    return se.ItemOut(id=response.item_id, role="assistant", status=status, content=content)


def _frame_out(result: FrameResult, origin: FrameOrigin) -> se.FrameOut:
    return se.FrameOut(
        index=result.index, kind=origin.kind, status=result.status.value, reason=result.reason,
        num_input_tokens=origin.num_input_tokens, num_tokens=len(result.token_ids),
        arrival_s=result.arrival_s, start_s=result.start_s, finish_s=result.finish_s,
        deadline_at_s=result.deadline_at_s, latency_ms=result.latency_s * 1e3,
        deadline_met=result.deadline_met, good=result.good, audio_end_ms=origin.audio_end_ms,
    )


def _response_out(result: FrameResult, origin: FrameOrigin, status: str,
                  item: se.ItemOut) -> se.ResponseOut:
    reason = None
    if status == "cancelled" and result.reason in (TURN_DETECTED, CLIENT_CANCELLED):
        reason = result.reason
    error = None
    if status == "failed":
        error = {"type": p.ErrorType.SERVER.value, "code": result.status.value,
                 "message": result.reason}
    num_output = len(result.token_ids)
    return se.ResponseOut(
        id=origin.response.response_id, status=status,
        status_details=se.StatusDetails(type=status, reason=reason, error=error),
        output=[item], metadata=origin.response.metadata,
        usage=se.Usage(total_tokens=origin.num_input_tokens + num_output,
                       input_tokens=origin.num_input_tokens, output_tokens=num_output),
    )
