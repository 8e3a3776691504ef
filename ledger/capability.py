"""Per-rollout capture capabilities (issue 13, point 1).

A harness can be given only a base URL and an API key.  The trainer mints, for each rollout, a
capability that the harness uses as its API key: ``rlc1~<rollout_id>~<mac>``, where ``mac`` is
the unpadded base64url HMAC-SHA256 of the rollout id under a server secret.  The proxy accepts
it for that rollout's routes only, and never sends it upstream.

The secret comes from the environment (``ROLLOUT_LEDGER_CAPTURE_SECRET`` by default) and is
shared by the trainer that mints and the service that checks; it must be at least
``MIN_SECRET_LEN`` characters.  Anyone holding a capability can write calls into that one
rollout (or mark it incomplete), nothing else.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

from ledger.errors import InvalidInput
from ledger.ids import is_valid_id, validate_rollout_id

__all__ = [
    "MIN_SECRET_LEN",
    "PREFIX",
    "SECRET_ENV",
    "mint_capability",
    "rollout_of_capability",
    "secret_from_env",
]

PREFIX = "rlc1"
SEP = "~"  # not in the rollout-id alphabet nor in base64url, and allowed in a bearer token
SECRET_ENV = "ROLLOUT_LEDGER_CAPTURE_SECRET"
MIN_SECRET_LEN = 32
_DOMAIN = b"rollout-ledger capture capability v1\x00"


def _check_secret(secret: str) -> bytes:
    if len(secret) < MIN_SECRET_LEN:
        raise InvalidInput(
            f"the capture secret must be at least {MIN_SECRET_LEN} characters (for example "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return secret.encode()


def _mac(secret: bytes, rollout_id: str) -> str:
    digest = hmac.new(secret, _DOMAIN + rollout_id.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def secret_from_env(name: str = SECRET_ENV) -> str:
    """The capture secret from the environment; a clear error when it is missing."""
    value = os.environ.get(name, "")
    if not value:
        raise InvalidInput(f"no capture secret: set {name} (the same value the service uses)")
    return value


def mint_capability(rollout_id: str, secret: str | None = None) -> str:
    """The API key to give the harness of ``rollout_id`` (secret: argument, else environment)."""
    validate_rollout_id(rollout_id)
    key = _check_secret(secret if secret is not None else secret_from_env())
    return f"{PREFIX}{SEP}{rollout_id}{SEP}{_mac(key, rollout_id)}"


def rollout_of_capability(presented: str, secret: str) -> str | None:
    """The rollout a presented capability is valid for, or ``None`` (constant-time compare)."""
    parts = presented.split(SEP)
    if len(parts) != 3 or parts[0] != PREFIX or not is_valid_id(parts[1]):
        return None
    expected = _mac(_check_secret(secret), parts[1])
    if not hmac.compare_digest(expected.encode(), parts[2].encode()):
        return None
    return parts[1]
