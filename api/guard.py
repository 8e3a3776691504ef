"""Requests the service answers itself, never upstream (issue 13, points 5 and 8).

* :class:`BrowserGuard` (ASGI middleware): in the no-token mode the service trusts the network
  position of its callers, which a web page can borrow (DNS rebinding, cross-site requests).
  So, when no tokens are configured: the ``Host`` must be a loopback name (or one listed in
  ``auth.allowed_hosts``, or the address the service listens on; probes of ``/healthz`` and
  ``/metrics`` are exempt); a request with an ``Origin``
  must come from such a host; and state-changing ledger routes need ``Content-Type:
  application/json`` (which a cross-site page cannot send without a CORS preflight, and the
  service never approves one).
* :func:`local_answer`, asked by the proxy before anything is forwarded: nothing under
  ``/ledger`` (any case, trailing slash or not) ever goes upstream: such a near-miss of a ledger
  route is a local 404, so the ledger token it carries stays here; a path with ``.``/``..``
  segments (``%2e%2e`` decodes to ``..``) is refused instead of escaping the upstream's base
  path; a CORS preflight (``OPTIONS``) on an ``/ng-rollout/`` route is answered here (no CORS
  grant) and records nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from api.errors import error_body
from ledger.config import Settings

__all__ = ["BrowserGuard", "allowed_host", "local_answer", "public_answer_headers"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LEDGER_PREFIX = "/ledger/"
OPS_PATHS = frozenset({"/healthz", "/metrics"})


def _hostname(value: str) -> str:
    """``Host``/authority without its port, lower-case, IPv6 brackets removed."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def allowed_host(settings: Settings, host: str) -> bool:
    name = _hostname(host)
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    if name in {_hostname(h) for h in settings.auth.allowed_hosts}:
        return True
    bind = _hostname(settings.host)
    return bind not in WILDCARD_BINDS and name == bind


def _json_content_type(value: str) -> bool:
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class BrowserGuard:
    """Host, Origin and content-type checks for the no-token mode (see module docstring)."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._has_credentials_mode():
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem = self._problem(scope, headers)
        if problem is None:
            await self.app(scope, receive, send)
            return
        status, code, message = problem
        response = JSONResponse(error_body(code, message), status_code=status)
        await response(scope, receive, send)

    def _has_credentials_mode(self) -> bool:
        # Without API tokens the ledger API is open, so the checks apply (a capture secret
        # guards the proxy only).
        return bool(self.settings.tokens)

    def _problem(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str, str] | None:
        path = str(scope.get("path", ""))
        method = str(scope.get("method", "")).upper()
        if method in ("GET", "HEAD") and path in OPS_PATHS:
            return None  # probes and scrapers use whatever address they reach; nothing secret
        host = headers.get("host")
        if host is not None and not allowed_host(self.settings, host):
            return (
                421,
                "host_not_allowed",
                f"Host {host!r} is not served: with no API tokens configured this service "
                "answers loopback names only (list others in auth.allowed_hosts)",
            )
        origin = headers.get("origin")
        if origin is not None and not allowed_host(self.settings, urlsplit(origin).netloc):
            return (
                403,
                "origin_not_allowed",
                f"cross-site request from Origin {origin!r} refused (no API tokens configured)",
            )
        if (
            method in STATE_CHANGING
            and path.startswith(LEDGER_PREFIX)
            and not _json_content_type(headers.get("content-type", ""))
        ):
            return (
                415,
                "unsupported_media_type",
                f"{method} {path} needs 'Content-Type: application/json' (also without a body)",
            )
        return None


def _has_dot_segment(path: str) -> bool:
    return any(segment in (".", "..") for segment in path.split("/"))


def local_answer(request: Request, path: str) -> Response | None:
    """The answer for a request the proxy must not forward, or ``None`` to go on."""
    lowered = path.lower()
    if (
        lowered == "/ledger"
        or lowered.startswith(LEDGER_PREFIX)
        or lowered.rstrip("/") in (OPS_PATHS)
    ):
        return JSONResponse(
            error_body(
                "not_found",
                f"no route {request.method} {path}: ledger routes live under /ledger/v1/ (exact "
                "case, no trailing slash) and are never forwarded upstream",
            ),
            status_code=404,
        )
    if _has_dot_segment(path):
        return JSONResponse(
            error_body(
                "invalid_path",
                f"the path {path!r} has '.' or '..' segments; the proxy forwards normalised "
                "paths only",
            ),
            status_code=400,
        )
    if request.method.upper() == "OPTIONS" and lowered.startswith("/ng-rollout/"):
        # Harnesses are not browsers: a preflight gets no CORS grant, and it is not a model
        # call, so it is neither forwarded nor held against the rollout.
        return Response(status_code=204, headers={"allow": "GET, POST, HEAD"})
    return None


def public_answer_headers(headers: dict[str, str], upstream_base: str) -> dict[str, str]:
    """Answer headers without the upstream's internal address: a redirect to the upstream
    itself becomes a path on this proxy (``Location: /v1/models``), so the harness never
    learns (nor bypasses the proxy to) the inference server's URL."""
    out = dict(headers)
    for key, value in headers.items():
        if key.lower() != "location":
            continue
        target = urlsplit(value)
        base = urlsplit(upstream_base)
        if target.netloc and target.netloc.lower() == base.netloc.lower():
            path = target.path
            prefix = base.path.rstrip("/")
            if prefix and path.startswith(prefix + "/"):
                path = path[len(prefix) :]
            out[key] = path + (f"?{target.query}" if target.query else "")
        elif target.netloc:
            # Another absolute address behind the proxy: not ours to reveal.
            del out[key]
    return out
