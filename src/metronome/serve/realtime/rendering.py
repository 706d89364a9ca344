"""What a reply and a frame's result become on the wire: server events rendered from the
runtime's `Frame` (its result) and the reply it answers (the frame's `tag`: a `Reply`, read
here through its ids, `ResponseIds`).

A frame that asked for output is one response. It opens (`response_opened`) when it is
created: `response.created`, its assistant item added (`response.output_item.added`,
`conversation.item.added`) and its text part (`response.content_part.added`). Its text
streams as the model writes it (`response.output_text.delta`, the reply's own). When the beat
answers its frame it closes (`result_events`): `response.output_text.done`, the part, the
item (`response.output_item.done`, `conversation.item.done`) and `response.done` with the
response's status, from the frame's (ok: completed, or incomplete with
`max_output_tokens` when its budget ran out before the model stopped; late: incomplete;
cancelled: cancelled, with `turn_detected` or `client_cancelled` when one of those cancelled
it; any other: failed, the frame's status as the error code). `metronome.frame` (the frame's
status and server-side timing) goes in between, to a client that opted in, and
`metronome.reply` (its first output and its gaps: `serve.realtime.pacing`) just before
`response.done`. A frame without output (turn-mode prefill) is its `metronome.frame` alone.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Protocol

from metronome.serve import protocol as p
from metronome.serve.protocol import server as se
from metronome.stream import Frame, FrameStatus

TURN_DETECTED: Final = "turn_detected"  # a response cancelled because the user spoke (OpenAI's)
CLIENT_CANCELLED: Final = "client_cancelled"  # cancelled by `response.cancel` (OpenAI's)
MAX_OUTPUT_TOKENS: Final = "max_output_tokens"  # incomplete: its budget ran out (OpenAI's)
ResponseStatus = Literal["completed", "incomplete", "cancelled", "failed"]
ItemStatus = Literal["completed", "incomplete", "in_progress"]


class ResponseIds(Protocol):
    """A response's ids, fixed when it opens (`serve.realtime.reply.Reply` has them)."""

    @property
    def response_id(self) -> str: ...

    @property
    def item_id(self) -> str:
        """Its assistant item."""

    @property
    def previous_item_id(self) -> str | None:
        """The conversation's last item when it opened."""

    @property
    def metadata(self) -> dict[str, str] | None: ...


_RESPONSE_STATUS: dict[FrameStatus | None, ResponseStatus] = {  # frame's -> response's
    FrameStatus.OK: "completed",
    FrameStatus.LATE: "incomplete",
    FrameStatus.CANCELLED: "cancelled",
}


def response_opened(response: ResponseIds, spoken: bool = False) -> list[p.ServerEvent]:
    item = assistant_item(response, "in_progress", None)
    return [
        se.ResponseCreated(response=se.ResponseOut(
            id=response.response_id, status="in_progress", metadata=response.metadata,
            output_modalities=["audio"] if spoken else ["text"])),
        se.ResponseOutputItemAdded(response_id=response.response_id, item=item),
        se.ConversationItemAdded(previous_item_id=response.previous_item_id, item=item),
        se.ResponseContentPartAdded(response_id=response.response_id, item_id=response.item_id,
                                    part=se.AudioPartOut() if spoken else se.PartOut()),
    ]


def result_events(frame: Frame[Any], response: ResponseIds | None, text: str, extensions: bool,
                  spoken: bool = False, budget_spent: bool = False,
                  pacing: se.ReplyOut | None = None) -> list[p.ServerEvent]:
    """The events of one frame's result, in the order they go out; `response`: the reply it
    answers (None: a frame without output); `text`: its output, decoded (its deltas went out
    as it was written); `extensions`: the client opted in to `metronome.*` events; `spoken`:
    its response is being spoken, so it closes later (`spoken_close_events`), not here;
    `budget_spent`: its output budget ran out before the model stopped; `pacing`: its
    listener's account, for a client that opted in (`metronome.reply`)."""
    events: list[p.ServerEvent] = []
    if extensions:
        events.append(se.MetronomeFrame(
            response_id=response.response_id if response else None,
            frame=_frame_out(frame)))
    if response is None or spoken:
        return events
    status = _status(frame, None, budget_spent)
    item = assistant_item(response, "completed" if status == "completed" else "incomplete", text)
    rid, item_id = response.response_id, response.item_id
    events += [
        se.ResponseOutputTextDone(response_id=rid, item_id=item_id, text=text),
        se.ResponseContentPartDone(response_id=rid, item_id=item_id, part=se.PartOut(text=text)),
        se.ResponseOutputItemDone(response_id=rid, item=item),
        se.ConversationItemDone(previous_item_id=response.previous_item_id, item=item),
    ]
    if pacing is not None:
        events.append(se.MetronomeReply(response_id=rid, reply=pacing))
    events.append(se.ResponseDone(response=_response_out(frame, response, status, item,
                                                         budget_spent=budget_spent)))
    return events


def _status(frame: Frame[Any], cancelled_reason: str | None,
            budget_spent: bool) -> ResponseStatus:
    if cancelled_reason:
        return "cancelled"
    status = _RESPONSE_STATUS.get(frame.status, "failed")
    return "incomplete" if status == "completed" and budget_spent else status


def spoken_close_events(frame: Frame[Any], response: ResponseIds, transcript: str,
                        cancelled_reason: str | None, budget_spent: bool = False,
                        pacing: se.ReplyOut | None = None) -> list[p.ServerEvent]:
    """A spoken response's closing events, once its last sentence went out (or a cancel
    stopped it: `cancelled_reason`, then the response is `cancelled`); `pacing`: its
    listener's account, for a client that opted in (`metronome.reply`)."""
    status = _status(frame, cancelled_reason, budget_spent)
    rid, item_id = response.response_id, response.item_id
    item = assistant_item(response, "completed" if status == "completed" else "incomplete",
                          transcript, spoken=True)
    done = _response_out(frame, response, status, item, cancelled_reason, spoken=True,
                         budget_spent=budget_spent)
    extension: list[p.ServerEvent] = [] if pacing is None else [
        se.MetronomeReply(response_id=rid, reply=pacing)]
    return [
        se.ResponseOutputAudioDone(response_id=rid, item_id=item_id),
        se.ResponseOutputAudioTranscriptDone(response_id=rid, item_id=item_id,
                                             transcript=transcript),
        se.ResponseContentPartDone(response_id=rid, item_id=item_id,
                                   part=se.AudioPartOut(transcript=transcript)),
        se.ResponseOutputItemDone(response_id=rid, item=item),
        se.ConversationItemDone(previous_item_id=response.previous_item_id, item=item),
        *extension,
        se.ResponseDone(response=done),
    ]


def assistant_item(response: ResponseIds, status: ItemStatus, text: str | None,
                   spoken: bool = False) -> se.ItemOut:
    """A response's output item; `text` None: no content yet (in progress); `spoken`: its
    content is audio, `text` its transcript."""
    content = [] if text is None else [
        se.ContentOut(type="output_audio", transcript=text) if spoken
        else se.ContentOut(type="output_text", text=text)]
    return se.ItemOut(id=response.item_id, role="assistant", status=status, content=content)


def _frame_out(frame: Frame[Any]) -> se.FrameOut:
    assert frame.status is not None and frame.index is not None, "an answered frame's"
    return se.FrameOut(
        index=frame.index, kind=frame.kind, status=frame.status.value, reason=frame.reason,
        num_input_tokens=frame.input_tokens, num_tokens=len(frame.token_ids),
        arrival_s=frame.arrival_s, start_s=frame.start_s, finish_s=frame.finish_s,
        deadline_at_s=frame.deadline_at_s, latency_ms=frame.latency_s * 1e3,
        deadline_met=frame.deadline_met, good=frame.good, audio_end_ms=frame.audio_end_ms,
    )


def _response_out(frame: Frame[Any], response: ResponseIds, status: ResponseStatus,
                  item: se.ItemOut, cancelled_reason: str | None = None,
                  spoken: bool = False, budget_spent: bool = False) -> se.ResponseOut:
    reason = cancelled_reason
    if status == "cancelled" and frame.reason in (TURN_DETECTED, CLIENT_CANCELLED):
        reason = reason or frame.reason
    if status == "incomplete" and budget_spent:
        reason = MAX_OUTPUT_TOKENS
    error = None
    if status == "failed":
        error = {"type": p.ErrorType.SERVER.value, "code": str(frame.status),
                 "message": frame.reason}
    num_output = len(frame.token_ids)
    return se.ResponseOut(
        id=response.response_id, status=status,
        status_details=se.StatusDetails(type=status, reason=_openai_reason(reason),
                                        error=error),
        output=[item], metadata=response.metadata,
        output_modalities=["audio"] if spoken else ["text"],
        usage=se.Usage(total_tokens=frame.input_tokens + num_output,
                       input_tokens=frame.input_tokens, output_tokens=num_output),
    )


def _openai_reason(reason: str | None) -> se.StatusReason | None:
    """A response's reason as OpenAI names one (cancelled: by a turn or the client;
    incomplete: its `max_output_tokens`); any other (the session closed, its client dropped
    and it is held for a resume) is told by none (the `metronome.frame` of its frame has it)."""
    if reason in (TURN_DETECTED, CLIENT_CANCELLED, MAX_OUTPUT_TOKENS):
        return reason  # type: ignore[return-value]
    return None
