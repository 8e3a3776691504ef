"""Routing (design §5.1): which proxy path is training capture, evaluation correlation or
plain pass-through, and the pass-through itself.

``/ng-rollout/<id>/training-token-capture/<rest>`` is training capture (``api.proxy.capture``
for a generating route, with the dialect handler its path names).  ``/ng-rollout/<id>/<rest>``
is evaluation correlation and any other path is plain pass-through: forwarded as is (streamed
both ways), nothing recorded.  An unrecognised training route is forwarded and marks the
rollout incomplete unless it is provably harmless.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask
from starlette.routing import Match
from starlette.types import Scope

from api.capability import check_proxy_credential
from api.guard import local_answer, public_answer_headers
from api.proxy.capture import capture, count_tokens
from api.proxy.handlers import GENERATING
from api.proxy.headers import HOP_BY_HOP, upstream_headers
from ledger.config import NonGeneratingRoute, Settings
from ledger.errors import LedgerError
from ledger.ids import ALLOWED_ID_TEXT, MAX_ROLLOUT_ID_LEN, is_valid_id
from ledger.store import Ledger

log = logging.getLogger("rollout_ledger.proxy")

TRAINING = "training-token-capture"
PREFIX_RE = re.compile(
    r"^/ng-rollout/(?P<id>[^/]*)(?P<training>/training-token-capture)?(?P<rest>/.*)?$"
)
COUNT_TOKENS = "/v1/messages/count_tokens"
_PATH_SAFE = "/:@!$&'()*+,;=~"  # RFC 3986 pchar delimiters kept as they are
# Routes of a vLLM upstream whose successful answers cannot carry policy text.
DEFAULT_NON_GENERATING = (
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/ping"),
    ("HEAD", "/api/hello"),
    ("GET", "/api/hello"),
)


_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class _RolloutRoute(APIRoute):
    """The catch-all route restricted to ``/ng-rollout/`` paths."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        path = scope.get("path")
        if isinstance(path, str) and path.startswith("/ng-rollout/"):
            return super().matches(scope)
        return Match.NONE, {}


def _declared(settings: Settings) -> frozenset[tuple[str, str]]:
    extra = [(r.method, r.path) for r in settings.token_id_capture_non_generating_requests]
    return frozenset([*DEFAULT_NON_GENERATING, *extra])


def install_proxy(app: FastAPI, settings: Settings) -> None:
    """Register the catch-all proxy route (after the ledger API, so those paths win)."""
    declared = _declared(settings)
    # Validate declarations once more at startup (config already refuses bad ones).
    for method, path in declared:
        NonGeneratingRoute(method=method, path=path)

    @app.api_route("/{full_path:path}", methods=_METHODS, include_in_schema=False)
    async def proxy(request: Request, full_path: str) -> Response:
        path = "/" + full_path
        if (local := local_answer(request, path)) is not None:
            return local
        if settings.upstream is None:
            return _no_upstream(path)
        match = PREFIX_RE.match(path)
        if match is None:
            if (refused := check_proxy_credential(request, settings, None, path)) is not None:
                return refused
            return await forward(request, path)
        rollout_id = match.group("id")
        if not is_valid_id(rollout_id):
            return JSONResponse(
                {
                    "error": {
                        "code": "invalid_rollout_id",
                        "message": (
                            f"rollout id in the URL must be {ALLOWED_ID_TEXT}, at most "
                            f"{MAX_ROLLOUT_ID_LEN} characters; got {rollout_id!r}"
                        ),
                    }
                },
                status_code=400,
            )
        rest = match.group("rest") or "/"
        if (refused := check_proxy_credential(request, settings, rollout_id, rest)) is not None:
            return refused
        if not match.group("training"):
            return await forward(request, rest)
        return await _training(request, rollout_id, rest, settings, declared)

    # The same handler, first in the route table for /ng-rollout/ paths: a proxied call then
    # skips matching every ledger API route before it reaches the catch-all (no ledger route
    # lives under /ng-rollout/, so what answers is unchanged).
    app.router.add_api_route(
        "/{full_path:path}",
        proxy,
        methods=_METHODS,
        include_in_schema=False,
        route_class_override=_RolloutRoute,
    )
    app.router.routes.insert(0, app.router.routes.pop())


def _no_upstream(path: str) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "code": "no_upstream",
                "message": (
                    f"no upstream is configured, so {path} cannot be proxied: start the "
                    "service with --upstream URL (for example http://127.0.0.1:8000/v1)"
                ),
            }
        },
        status_code=503,
    )


async def forward(request: Request, path: str) -> Response:
    """Plain pass-through: stream the request up and the answer back, record nothing."""
    client: httpx.AsyncClient = request.app.state.upstream
    headers = upstream_headers(request)
    if "accept-encoding" not in {k.lower() for k in headers}:
        # Not httpx's default (gzip, ...): the raw answer goes back to a harness that did
        # not offer to decode anything.
        headers["accept-encoding"] = "identity"
    try:
        upstream_req = client.build_request(
            request.method,
            # The decoded path, percent-encoded again (a %00 or a space must not reach the
            # URL builder raw).
            quote(path, safe=_PATH_SAFE),
            params=request.url.query or None,
            headers=headers,
            content=request.stream(),
        )
    except httpx.InvalidURL as exc:
        return JSONResponse({"error": {"code": "invalid_path", "message": str(exc)}}, 400)
    try:
        upstream = await client.send(upstream_req, stream=True)
    except httpx.TimeoutException as exc:
        return JSONResponse({"error": {"code": "upstream_timeout", "message": str(exc)}}, 504)
    except httpx.HTTPError as exc:
        return JSONResponse({"error": {"code": "upstream_unavailable", "message": str(exc)}}, 502)
    # The raw bytes go back still encoded, so their content-encoding goes with them.
    answer_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    answer_headers = public_answer_headers(answer_headers, str(client.base_url))
    return StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        headers=answer_headers,
        background=BackgroundTask(upstream.aclose),
    )


async def _training(
    request: Request,
    rollout_id: str,
    rest: str,
    settings: Settings,
    declared: frozenset[tuple[str, str]],
) -> Response:
    method = request.method.upper()
    if method == "POST" and rest == COUNT_TOKENS:
        return await count_tokens(request)
    handler = GENERATING.get(rest) if method == "POST" else None
    if handler is None:
        return await _non_generating(request, rollout_id, method, rest, declared)
    return await capture(request, rollout_id, rest, settings, handler)


async def _non_generating(
    request: Request,
    rollout_id: str,
    method: str,
    rest: str,
    declared: frozenset[tuple[str, str]],
) -> Response:
    """Forward an unrecognised training route; mark incomplete unless provably harmless.

    404/405 cannot have produced policy text.  A declared (method, path) passes when it
    succeeds.  Any other outcome (2xx/3xx of an undeclared route, 5xx, an exception, no
    response) may have put policy text in front of the harness: the rollout is incomplete.
    """
    route = f"{method} {rest}"
    try:
        response = await forward(request, rest)
    except Exception as exc:
        await _mark_route(request, rollout_id, route, f"exception: {exc}")
        raise
    status = response.status_code
    harmless = status in (404, 405) or ((method, rest) in declared and 200 <= status < 300)
    if not harmless:
        await _mark_route(request, rollout_id, route, f"status {status}")
    return response


async def _mark_route(request: Request, rollout_id: str, route: str, outcome: str) -> None:
    ledger: Ledger = request.app.state.ledger
    try:
        await ledger.mark_incomplete(
            rollout_id,
            reason="unrecognized_route",
            detail=f"{route} -> {outcome}; declare it in token_id_capture_non_generating_requests "
            "only if its answers can never carry policy-generated text",
        )
    except LedgerError as exc:
        log.error("could not mark rollout=%s incomplete for %s: %s", rollout_id, route, exc)
    else:
        request.app.state.metrics.incomplete.labels("unrecognized_route").inc()
