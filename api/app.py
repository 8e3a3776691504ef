"""The FastAPI application: capture proxy and ledger API in one process."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api import errors
from api.guard import BrowserGuard
from api.health import HealthCheck
from api.limits import discover_context_length, record_token_cap
from api.metrics import Metrics
from api.proxy.known_prompts import KnownPrompts
from api.routes import router as ledger_router
from api.upstream import POOL_IDLE_S, AiohttpPoster, HttpxPoster
from ledger.config import Settings
from ledger.redact import install_log_redaction
from ledger.store import Ledger

log = logging.getLogger("rollout_ledger.api")

# Allocations between young-generation collections in ``serve`` (the interpreter's default is
# 700).  A proxied call makes a few thousand objects (a log-prob entry is three) and holds
# several lists of context length while it runs, which every young collection walks: at the
# default a 16k-token call paid about one such walk (~0.15 ms) each time.  Objects freed by
# reference counting (nearly all of a call's) never wait for a collection, so this changes how
# often cycles are looked for, not how much memory a call keeps.
YOUNG_GC_THRESHOLD = 10_000

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` with a 413 before any handler sees them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise errors.BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except errors.BodyTooLarge:
            if not started:
                await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        resp = JSONResponse(
            errors.error_body(
                "payload_too_large",
                f"request body exceeds the configured limit of {self.max_bytes} bytes "
                "(max_body_bytes)",
            ),
            status_code=413,
        )
        await resp({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def create_app(
    settings: Settings,
    *,
    ledger: Ledger | None = None,
    upstream_transport: httpx.AsyncBaseTransport | None = None,
    freeze_gc: bool = False,
) -> FastAPI:
    """Build the app.  ``ledger``/``upstream_transport`` let tests inject real parts.

    ``freeze_gc`` (``serve``): once started, everything alive (modules, SQLAlchemy and pydantic
    machinery, the app: most of the heap) moves to the collector's permanent generation, so a
    full collection triggered by a call no longer scans it; on a 16k-token call such collections
    cost more CPU than the call's own work.  The young generation is also collected less often
    (:data:`YOUNG_GC_THRESHOLD`).  Not for processes that build many apps (tests): frozen
    objects are never collected."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own_ledger = ledger is None
        app.state.ledger = ledger or Ledger(
            settings.db, delta_records=settings.token_id_capture.delta_records, auto_migrate=True
        )
        await app.state.ledger.ensure_schema()
        app.state.health = HealthCheck(lambda: app.state.ledger, settings.upstream)
        timeout = httpx.Timeout(
            settings.upstream_timeout_s, connect=settings.upstream_connect_timeout_s
        )
        base, credentials = _split_userinfo(settings.upstream or "http://upstream.invalid")
        if settings.upstream_api_key:
            credentials = None  # the configured key is sent as a bearer token instead
        app.state.upstream = httpx.AsyncClient(
            # Credentials in the URL go into an auth object, so no log line shows them.
            base_url=base,
            auth=httpx.BasicAuth(*credentials) if credentials else None,
            timeout=timeout,
            transport=upstream_transport,
            # Idle connections go before the engine's server closes them (``api.upstream``).
            limits=httpx.Limits(
                max_connections=512, max_keepalive_connections=128, keepalive_expiry=POOL_IDLE_S
            ),
        )
        # The generating POST: over aiohttp, unless a test injected an httpx transport.
        app.state.upstream_post = (
            HttpxPoster(app.state.upstream)
            if upstream_transport is not None
            else AiohttpPoster(
                base,
                timeout_s=settings.upstream_timeout_s,
                connect_timeout_s=settings.upstream_connect_timeout_s,
                basic_auth=credentials,
                on_resend=app.state.metrics.upstream_retries.inc,
            )
        )
        discovered = None
        if settings.upstream is not None and settings.max_record_tokens is None:
            key = settings.upstream_api_key
            headers = {"authorization": f"Bearer {key}"} if key else {}
            discovered = await discover_context_length(app.state.upstream, headers)
        app.state.max_record_tokens = record_token_cap(settings, discovered)
        threshold = gc.get_threshold()
        if freeze_gc:
            gc.collect()
            gc.freeze()
            gc.set_threshold(YOUNG_GC_THRESHOLD, *threshold[1:])
        try:
            yield
        finally:
            if freeze_gc:  # as it was: an app served in a test leaves nothing behind
                gc.unfreeze()
                gc.set_threshold(*threshold)
            await app.state.upstream_post.aclose()
            await app.state.upstream.aclose()
            if own_ledger:
                await app.state.ledger.close()

    app = errors.new_app(
        settings,
        title="rollout-ledger",
        summary="Capture proxy and SQL ledger for exact training tokens.",
        lifespan=lifespan,
    )
    app.state.metrics = Metrics()
    app.state.known_prompts = KnownPrompts()
    app.state.max_record_tokens = record_token_cap(settings, None)
    install_log_redaction(*REDACTED_LOGGERS)
    app.include_router(ledger_router)

    @app.get("/healthz", tags=["ops"])
    async def healthz(request: Request) -> JSONResponse:
        """Database reachable and schema at head (pooled, shared by concurrent probes)."""
        health: HealthCheck = request.app.state.health
        status, body = await health.check()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", tags=["ops"], include_in_schema=False)
    async def metrics(request: Request) -> Response:
        return Response(
            generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    from api.proxy import install_proxy
    from api.ui import install as install_ui

    install_ui(app)  # the audit page at /ui and /docs, before the proxy's catch-all route

    install_proxy(app, settings)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BrowserGuard, settings=settings)
    return app


# Loggers whose lines may carry URLs (httpx logs every request with its full URL).
REDACTED_LOGGERS = (
    "httpx",
    "httpcore",
    "uvicorn.error",
    "rollout_ledger.api",
    "rollout_ledger.api.ledger",
    "rollout_ledger.proxy",
)


def _split_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """``http://user:pw@host/x`` → (``http://host/x``, (user, pw))."""
    parsed = httpx.URL(url)
    if not parsed.userinfo:
        return url, None
    return str(parsed.copy_with(username=None, password=None)), (parsed.username, parsed.password)
