"""The wire protocol: OpenAI's Realtime API (GA), typed.

`client` parses client events (bounded JSON: `bounded_json`), `server` holds the server
events (the GA events and the `metronome.*` extensions), `schema` the session object,
`errors` the error codes and `ClientError`. The names a session handler uses most are
here, so `from metronome.serve import protocol as p` reads `p.SessionUpdate`,
`p.ClientError`, `p.ErrorEvent`.
"""

from metronome.serve.protocol.client import (
    CLIENT_EVENT_TYPES,
    EXTENSIONS_QUERY,
    ClientEvent,
    ConversationItemCreate,
    ConversationItemDelete,
    ConversationItemRetrieve,
    ConversationItemTruncate,
    InputAudioBufferAppend,
    InputAudioBufferClear,
    InputAudioBufferCommit,
    OutputAudioBufferClear,
    ResponseCancel,
    ResponseCreate,
    ResponseParamsIn,
    SessionUpdate,
    parse_client_event,
    readable_event_id,
    with_extensions,
)
from metronome.serve.protocol.errors import ClientError, ErrorCode, ErrorType
from metronome.serve.protocol.schema import (
    AudioFormatIn,
    AudioIn,
    AudioInputIn,
    MetronomeSessionIn,
    SemanticVad,
    ServerVad,
    SessionIn,
    SessionOut,
)
from metronome.serve.protocol.server import (
    ErrorDetail,
    ErrorEvent,
    ServerEvent,
    new_id,
    text_bytes,
)

__all__ = [
    "CLIENT_EVENT_TYPES", "EXTENSIONS_QUERY", "AudioFormatIn", "AudioIn", "AudioInputIn",
    "ClientError", "ClientEvent", "ConversationItemCreate", "ConversationItemDelete",
    "ConversationItemRetrieve", "ConversationItemTruncate", "ErrorCode", "ErrorDetail",
    "ErrorEvent", "ErrorType", "InputAudioBufferAppend", "InputAudioBufferClear",
    "InputAudioBufferCommit", "MetronomeSessionIn", "OutputAudioBufferClear",
    "ResponseCancel", "ResponseCreate", "ResponseParamsIn", "SemanticVad", "ServerEvent",
    "ServerVad", "SessionIn", "SessionOut", "SessionUpdate", "new_id", "parse_client_event",
    "readable_event_id", "text_bytes", "with_extensions",
]
