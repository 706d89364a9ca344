"""The optional API key: where a client may offer it, how it is checked, and the HTTP guard.

A key is offered as `Authorization: Bearer <key>` or, from a browser (which cannot set
headers on a WebSocket), as the subprotocol `openai-insecure-api-key.<key>` beside
`realtime`, as OpenAI's browser clients send it. Keys are compared in constant time. The
accepted WebSocket echoes `realtime` when it was offered, never the key.

`KeyGuard` answers every HTTP request without the key 401 (the docs and the OpenAPI schema
too) except the paths it is told are open; WebSockets pass through to the connection, which
refuses them before the upgrade.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from metronome.serve import protocol as p

BEARER_PREFIX = "bearer "
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
REALTIME_SUBPROTOCOL = "realtime"


def offered_keys(authorization: str | None, subprotocols: Iterable[str]) -> list[str]:
    """Every key a client offers: the bearer header's, then a key subprotocol's."""
    keys = []
    if authorization is not None and authorization.lower().startswith(BEARER_PREFIX):
        keys.append(authorization[len(BEARER_PREFIX):].strip())
    keys += [s[len(KEY_SUBPROTOCOL_PREFIX):] for s in subprotocols
             if s.startswith(KEY_SUBPROTOCOL_PREFIX)]
    return keys


def key_matches(offered: list[str], api_key: SecretStr | None) -> bool:
    """True when no key is configured, or one of the offered keys is exactly that key."""
    if api_key is None:
        return True
    expected = api_key.get_secret_value().encode()
    return any(hmac.compare_digest(key.encode(), expected) for key in offered)


def chosen_subprotocol(subprotocols: Iterable[str]) -> str | None:
    """The subprotocol the accepted WebSocket echoes: `realtime` if offered (browsers fail
    a handshake that echoes none of those they sent)."""
    return REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in subprotocols else None


def unauthorized_response() -> JSONResponse:
    error = p.ErrorDetail(type=p.ErrorType.INVALID_REQUEST, code=p.ErrorCode.INVALID_API_KEY,
                          message="missing or invalid API key: send Authorization: Bearer "
                          f"<key> (browsers: the subprotocol {KEY_SUBPROTOCOL_PREFIX}<key>)")
    return JSONResponse({"error": error.model_dump(mode="json")}, status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


def request_has_key(scope: Scope, api_key: SecretStr | None) -> bool:
    headers = Headers(scope=scope)
    return key_matches(offered_keys(headers.get("authorization"), ()), api_key)


class KeyGuard:
    """ASGI middleware: HTTP requests without the key get 401, but on `open_paths`."""

    def __init__(self, app: ASGIApp, api_key: SecretStr | None,
                 open_paths: frozenset[str]) -> None:
        self.app = app
        self.api_key = api_key
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] not in self.open_paths
                and not request_has_key(scope, self.api_key)):
            await unauthorized_response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
