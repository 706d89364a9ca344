"""Optional API key: `Authorization: Bearer <key>`, compared in constant time."""

from __future__ import annotations

import hmac

from pydantic import SecretStr

BEARER_PREFIX = "bearer "


def bearer_matches(authorization: str | None, api_key: SecretStr | None) -> bool:
    """True when no key is configured, or the header carries exactly that key."""
    if api_key is None:
        return True
    if authorization is None or not authorization.lower().startswith(BEARER_PREFIX):
        return False
    offered = authorization[len(BEARER_PREFIX):].strip().encode()
    return hmac.compare_digest(offered, api_key.get_secret_value().encode())
