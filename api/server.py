"""How ``rollout-ledger serve`` runs uvicorn: bounded connections (issue 13, point 4).

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) but not a client that never
finishes its request: a connection that sends half a header line, or a body slower than a byte
a minute, is held for ever, and a few hundred of them take the service down.  So the server's
HTTP protocol has two read deadlines:

* ``header_timeout_s``: from the first byte of a request (or from the connection's opening)
  until its headers are complete;
* ``body_timeout_s``: from the complete headers until the complete body.

A connection that misses a deadline gets ``408 Request Timeout`` and is closed.  Requests the
application is still answering (a long model call) are not affected: the deadlines cover
reading the request only.  ``limit_concurrency`` caps connections plus in-flight requests;
beyond it uvicorn answers 503 instead of queueing without bound.  The request line and headers
are capped at :data:`MAX_HEAD_BYTES` (400 beyond).

The protocol is uvicorn's httptools one (a C parser: a 16k-token request parses in a fraction
of the pure-Python h11's time) when ``httptools`` is importable, else its h11 one; both carry
the same guards (:func:`guarded_httptools`, :func:`guarded_h11`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from ledger.config import Settings

__all__ = [
    "MAX_HEAD_BYTES",
    "MIN_TOKEN_LEN",
    "guarded_h11",
    "guarded_httptools",
    "guarded_protocol",
    "httptools_available",
    "serve_problem",
    "uvicorn_options",
]

MIN_TOKEN_LEN = 16
MAX_HEAD_BYTES = 16 * 1024  # request line + headers

_TIMEOUT_BODY = (
    b'{"error":{"code":"request_timeout","message":"the request was not received in time"}}'
)
_TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n"
) + _TIMEOUT_BODY


class _ReadDeadlines:
    """The deadline timer shared by both guarded protocols (mixed in before uvicorn's class).

    ``_phase``: "headers" (reading a request's headers), "body" (its body) or "app" (neither:
    the app answers, or the connection idles under uvicorn's keep-alive timeout)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 120.0
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def _start_deadlines(self) -> None:
        self._read_timer: asyncio.TimerHandle | None = None
        self._phase = "headers"
        self._arm(self.header_timeout_s)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._read_timeout)

    def _disarm(self) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
            self._read_timer = None

    def _read_timeout(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle: Any = getattr(self, "cycle", None)  # the request being read or answered
        if cycle is None or cycle.response_complete or not cycle.response_started:
            # The peer may be gone already; closing is what matters.
            with contextlib.suppress(Exception):
                self.transport.write(_TIMEOUT_ANSWER)
        self.transport.close()


class _GuardedH11(_ReadDeadlines, H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._seen_cycle: object = None
        self._start_deadlines()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == "app" and (self.cycle is None or self.cycle.response_complete):
            # The first bytes of a next request on a kept-alive connection.
            self._phase = "headers"
            self._arm(self.header_timeout_s)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None:
            return
        if cycle is not self._seen_cycle:  # headers complete: a new request started
            self._seen_cycle = cycle
            if cycle.more_body:
                self._phase = "body"
                self._arm(self.body_timeout_s)
            else:
                self._phase = "app"
                self._disarm()
        elif self._phase == "body" and not cycle.more_body:
            self._phase = "app"
            self._disarm()


def guarded_h11(header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """An h11 protocol class with the given read deadlines."""
    return type(
        "GuardedH11",
        (_GuardedH11,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )


def guarded_httptools(header_timeout_s: float, body_timeout_s: float) -> type[Any]:
    """An httptools protocol class with the given read deadlines and the head-size cap (h11
    has the cap built in; llhttp has none).  Needs ``httptools`` importable."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _GuardedHttpTools(_ReadDeadlines, HttpToolsProtocol):
        _head_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._start_deadlines()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        # Parser callbacks (called from ``feed_data``, in order, for each request).
        def on_message_begin(self) -> None:
            if self._phase != "headers":  # the first byte of a next request (keep-alive)
                self._phase = "headers"
                self._arm(self.header_timeout_s)
            self._head_bytes = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._phase = "body"
            self._arm(self.body_timeout_s)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._phase = "app"
            self._disarm()
            super().on_message_complete()

        def _count_head(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > MAX_HEAD_BYTES:
                # Raised in a parser callback: httptools reports it as a parser error, which
                # uvicorn answers with 400 and a close (as h11 does beyond its limit).
                raise ValueError("request line and headers exceed the limit")

    return type(
        "GuardedHttpTools",
        (_GuardedHttpTools,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )


def httptools_available() -> bool:
    return importlib.util.find_spec("httptools") is not None


def guarded_protocol(header_timeout_s: float, body_timeout_s: float) -> type[Any]:
    """The guarded httptools protocol when httptools is installed, else the guarded h11 one."""
    if httptools_available():
        return guarded_httptools(header_timeout_s, body_timeout_s)
    return guarded_h11(header_timeout_s, body_timeout_s)


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run``/``uvicorn.Config`` from ``settings.server``.

    The event loop is uvloop's (libuv) where it is installed (a dependency on Linux and
    macOS): each proxied call crosses the loop a few dozen times (the harness's socket, the
    upstream's, the group commit's hand-offs), and uvloop's are C calls."""
    server = settings.server
    return {
        "loop": "uvloop" if uvloop_available() else "asyncio",
        "http": guarded_protocol(server.header_timeout_s, server.body_timeout_s),
        "timeout_keep_alive": server.keep_alive_s,
        "limit_concurrency": server.max_connections,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }


def serve_problem(settings: Settings) -> str | None:
    """Why ``serve`` must not start with these credentials, or ``None``."""
    from ledger.capability import MIN_SECRET_LEN

    short = [t for t in settings.tokens if len(t) < MIN_TOKEN_LEN]
    if short:
        return (
            f"{len(short)} API token(s) in {settings.auth.tokens_env} are shorter than "
            f"{MIN_TOKEN_LEN} characters; use long random tokens (for example `python -c "
            "'import secrets; print(secrets.token_urlsafe(24))'`)"
        )
    secret = settings.capture_secret
    if secret is not None and len(secret) < MIN_SECRET_LEN:
        return (
            f"the capture secret in {settings.auth.capture_secret_env} is shorter than "
            f"{MIN_SECRET_LEN} characters"
        )
    return None
