"""Errors of the wire protocol: OpenAI's error types and codes, `ClientError` (a client event
that cannot be honoured: answered with an `error` event, the session lives on) and
`Refused` (a connection refused before the upgrade)."""

from __future__ import annotations

import enum


class ErrorType(enum.StrEnum):
    INVALID_REQUEST = "invalid_request_error"  # the client's fault: fix the request
    SERVER = "server_error"  # ours, or capacity: retry later


class ErrorCode(enum.StrEnum):
    INVALID_JSON = "invalid_json"
    BINARY_NOT_SUPPORTED = "binary_not_supported"
    MESSAGE_TOO_LARGE = "message_too_large"
    UNKNOWN_EVENT_TYPE = "unknown_event_type"
    UNKNOWN_PARAMETER = "unknown_parameter"
    MISSING_PARAMETER = "missing_required_parameter"
    INVALID_VALUE = "invalid_value"
    INVALID_AUDIO = "invalid_audio"
    AUDIO_UNSUPPORTED = "audio_input_unsupported"
    UNSUPPORTED_SAMPLE_RATE = "unsupported_sample_rate"
    SESSION_LOCKED = "session_locked"
    TEXT_TOO_LONG = "text_too_long"
    TEXT_UNSUPPORTED = "text_input_unsupported"
    BUFFER_OVERFLOW = "input_audio_buffer_overflow"  # audio sent faster than real time
    SERVER_BEHIND = "server_behind"  # real-time audio past --max-behind-audio-s unanswered
    TOO_MANY_PENDING = "too_many_pending_frames"
    COMMIT_EMPTY = "input_audio_buffer_commit_empty"
    ACTIVE_RESPONSE = "conversation_already_has_active_response"
    IDLE_TIMEOUT = "idle_timeout"
    SESSION_EXPIRED = "session_expired"
    AT_CAPACITY = "server_at_capacity"
    SERVER_DRAINING = "server_draining"  # its drain timeout passed: reconnect elsewhere
    INVALID_API_KEY = "invalid_api_key"
    RESUME_REFUSED = "resume_refused"  # unknown or ended session, wrong or used token
    RATE_LIMITED = "rate_limit_exceeded"
    UNSUPPORTED = "unsupported"  # a GA feature this server does not serve; the message says why
    ITEM_NOT_FOUND = "item_not_found"
    NOT_FOUND = "not_found"  # a path this listener does not serve
    RESPONSE_NOT_ACTIVE = "response_cancel_not_active"


class ClientError(Exception):
    """A client event that cannot be honoured; answered with an `error`, the session lives on."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None,
                 error_type: ErrorType = ErrorType.INVALID_REQUEST,
                 event_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.error_type = error_type
        self.event_id = event_id  # the client event's own id, when it could be read


class Refused(ClientError):
    """A connection refused before the upgrade: answered with HTTP `http_status` and the
    error (or, where the server cannot answer HTTP there, an accept, the `error` event and
    the close `close_code` with `close_reason`)."""

    def __init__(self, http_status: int, close_code: int, close_reason: str,
                 code: ErrorCode, message: str,
                 error_type: ErrorType = ErrorType.INVALID_REQUEST,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(code, message, error_type=error_type)
        self.http_status = http_status
        self.close_code = close_code
        self.close_reason = close_reason
        self.headers = headers
