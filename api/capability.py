"""Who may use the capture proxy, and which credential goes upstream (issue 13, point 1).

The proxy is guarded whenever the service is: when API tokens or a capture secret are
configured.  A guarded proxy route needs, as the harness's API key (``Authorization: Bearer`` or
``x-api-key``), either

* a capture capability (``ledger.capability``) for the rollout named in the path; on plain
  pass-through paths (no rollout) any valid capability; or
* an API token with the ``ingest`` (or ``admin``) scope, for trusted in-cluster callers.

Whatever the harness presented is then removed, and the upstream gets the configured upstream
key (``ROLLOUT_LEDGER_UPSTREAM_API_KEY``), or no credential at all.  Without tokens and secret
(the loopback-only mode) nothing is checked and the harness's own credential goes upstream, as
before.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from api.auth import scopes_of
from ledger.capability import rollout_of_capability
from ledger.config import Settings

__all__ = ["check_proxy_credential", "guarded", "upstream_credentials"]

_CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key", "api-key"})
_CAPTURE_SCOPES = frozenset({"ingest", "admin"})


def guarded(settings: Settings) -> bool:
    """Proxy routes need a credential when the service has tokens or a capture secret."""
    return bool(settings.tokens) or bool(settings.capture_secret)


def _presented(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    kind, _, value = header.partition(" ")
    if kind.lower() == "bearer" and value.strip():
        return value.strip()
    for name in ("x-api-key", "api-key"):
        if value := request.headers.get(name, "").strip():
            return value
    return None


def check_proxy_credential(
    request: Request, settings: Settings, rollout_id: str | None, path: str
) -> JSONResponse | None:
    """``None`` when the caller may use this proxy route; otherwise the 401/403 to answer."""
    if not guarded(settings):
        return None
    presented = _presented(request)
    if presented is None:
        return _refuse(
            401,
            path,
            "this proxy needs a credential: use the capture capability the trainer minted for "
            "this rollout as the API key (Authorization: Bearer or x-api-key)",
        )
    if settings.capture_secret:
        rid = rollout_of_capability(presented, settings.capture_secret)
        if rid is not None:
            if rollout_id is None or rid == rollout_id:
                return None
            return _refuse(
                403,
                path,
                f"this capture capability is for rollout {rid!r}, not {rollout_id!r}",
            )
    scopes = scopes_of(settings.tokens, presented)
    if scopes is not None and scopes & _CAPTURE_SCOPES:
        return None
    if scopes is not None:
        return _refuse(403, path, "this API token lacks the 'ingest' scope the proxy needs")
    return _refuse(401, path, "unknown API key: not a capture capability nor an API token")


def upstream_credentials(request: Request, headers: dict[str, str]) -> dict[str, str]:
    """``headers`` as they may go upstream: on a guarded proxy, the harness's credential is
    replaced by the configured upstream key (or removed)."""
    settings: Settings = request.app.state.settings
    if not guarded(settings):
        return headers
    out = {k: v for k, v in headers.items() if k.lower() not in _CREDENTIAL_HEADERS}
    if settings.upstream_api_key:
        out["authorization"] = f"Bearer {settings.upstream_api_key}"
    return out


def _refuse(status: int, path: str, message: str) -> JSONResponse:
    """The refusal in the dialect the harness speaks (Anthropic or OpenAI error shape)."""
    body: dict[str, Any]
    if path.startswith("/v1/messages"):
        kind = "authentication_error" if status == 401 else "permission_error"
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key" if status == 401 else "forbidden",
            }
        }
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)
