"""The capture proxy's generating POST to the inference server: the one upstream request on every
captured call's answer path.

It goes over aiohttp (C HTTP parser, a connection pool in C-backed structures): on a 16k-token
call the engine's answer is ~90 KB of JSON with every prompt id, and carrying it through httpx's
pure-Python stack (h11, httpcore, anyio) cost about 3 ms of the proxy's CPU per call against
about 1 ms through aiohttp (``docs/performance.md``).  Everything else the proxy sends upstream
(pass-through routes, streaming, ``/tokenize``) stays on the app's httpx client, which is also
what serves the generating POST when a test injects an httpx transport (its fault doubles).

Either way the caller sees one shape: an :class:`UpstreamAnswer` (status and body bytes) or an
:class:`UpstreamFailure` saying whether the connection was refused (nothing was sent, so a retry
cannot duplicate a generation), the request timed out, or the transport broke.

Pooled connections and the keep-alive race: an engine's server (uvicorn, under vLLM and
SGLang) closes a connection idle for 5 s.  A client that keeps idle connections longer
(aiohttp's default is 15 s) sometimes sends a request on a connection the server is closing
that moment: the request is reset before any answer, and the model call would fail with a 502
(seen under load: 2 of about 2,900 calls with 160 concurrent rollouts of 16k-token prompts).
aiohttp resends only idempotent requests in that case, never a POST.  So the pool here drops a
connection idle for :data:`POOL_IDLE_S` (less than those 5 s), and a POST that fails before any
answer byte on a *reused* connection is sent once more on a new one.  In the race the server
dropped the connection before its handler took the request; should the engine instead have
failed while generating, the retry costs one generation more, and only the answer the harness
gets is recorded either way.  A new connection that ends without an answer is not retried (the
engine took the request, and the harness's own retry decides).
"""

from __future__ import annotations

import base64
import logging
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal, Protocol

import aiohttp
import httpx

__all__ = [
    "AiohttpPoster",
    "HttpxPoster",
    "UpstreamAnswer",
    "UpstreamFailure",
    "UpstreamPoster",
]

log = logging.getLogger("rollout_ledger.proxy")

FailureKind = Literal["connect", "timeout", "transport"]

# How long an idle pooled connection to the engine is kept: under the 5 s after which uvicorn
# (vLLM's and SGLang's HTTP server) closes an idle connection.
POOL_IDLE_S = 4.0


class UpstreamFailure(Exception):
    """The upstream request failed before an answer came back.

    ``connect``: the connection was refused or could not be made (nothing was sent);
    ``timeout``: connecting or reading took longer than the configured limit;
    ``transport``: the connection broke (closed mid-answer, a malformed response)."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind: FailureKind = kind


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    status: int
    body: bytes


class UpstreamPoster(Protocol):
    async def post(
        self, path: str, payload: bytes, headers: Mapping[str, str]
    ) -> UpstreamAnswer: ...

    async def aclose(self) -> None: ...


class HttpxPoster:
    """The generating POST over the app's httpx client (used when a transport is injected)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def post(self, path: str, payload: bytes, headers: Mapping[str, str]) -> UpstreamAnswer:
        try:
            resp = await self._client.post(path, content=payload, headers=dict(headers))
            return UpstreamAnswer(resp.status_code, resp.content)
        except (httpx.HTTPError, ConnectionError) as exc:
            raise _failure(exc, timeout=httpx.TimeoutException, connect=httpx.ConnectError) from exc

    async def aclose(self) -> None:
        """The client is the app's; it closes it."""


class AiohttpPoster:
    """The generating POST over aiohttp, with the httpx client's settings: the same base URL
    (its path kept), credentials from the URL's userinfo as HTTP basic auth (they replace a
    harness's ``authorization``, as httpx's auth does), the connect and read timeouts, a
    512-connection pool, and the proxy the environment names for the upstream's URL
    (``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` unless ``NO_PROXY`` covers its host)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        basic_auth: tuple[str, str] | None = None,
        max_connections: int = 512,
        on_resend: Callable[[], object] | None = None,
    ) -> None:
        self._base = base_url.rstrip("/")
        self._on_resend = on_resend  # called when a POST is sent again (the keep-alive race)
        self._authorization = (
            "Basic " + base64.b64encode(f"{basic_auth[0]}:{basic_auth[1]}".encode()).decode()
            if basic_auth
            else None
        )
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=timeout_s,  # a free pooled connection, and connecting
            sock_connect=connect_timeout_s,
            sock_read=timeout_s,
        )
        self._max_connections = max_connections
        self._proxy = _env_proxy(self._base)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = self._new_session(
                aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=POOL_IDLE_S)
            )
        return self._session

    def _new_session(self, connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            # The environment's proxy is resolved once (_env_proxy); trusting the
            # environment would read it again, in a worker thread, on every request.
            trust_env=False,
            # No cookie jar: an upstream's cookies must not leak from one harness to another.
            cookie_jar=aiohttp.DummyCookieJar(),
            trace_configs=[_REUSE],
        )

    async def post(self, path: str, payload: bytes, headers: Mapping[str, str]) -> UpstreamAnswer:
        sent = dict(headers)
        if self._authorization is not None:
            for key in [k for k in sent if k.lower() == "authorization"]:
                del sent[key]
            sent["authorization"] = self._authorization
        url = self._base + path
        attempt = _Attempt()
        try:
            return await self._send(self._open(), url, payload, sent, attempt)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            if not attempt.stale(exc):
                raise _upstream_failure(exc) from exc
        # The keep-alive race (module docstring): once more, on a connection of its own.
        log.info("upstream dropped a reused connection before answering; sending %s again", path)
        if self._on_resend is not None:
            self._on_resend()
        try:
            async with self._new_session(aiohttp.TCPConnector(force_close=True)) as fresh:
                return await self._send(fresh, url, payload, sent, _Attempt())
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise _upstream_failure(exc) from exc

    async def _send(
        self,
        session: aiohttp.ClientSession,
        url: str,
        payload: bytes,
        headers: dict[str, str],
        attempt: _Attempt,
    ) -> UpstreamAnswer:
        async with session.post(
            url, data=payload, headers=headers, proxy=self._proxy, trace_request_ctx=attempt
        ) as resp:
            attempt.answered = True
            return UpstreamAnswer(resp.status, await resp.read())

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


class _Attempt:
    """One POST's connection history: whether it went out on a pooled (reused) connection, and
    whether the answer's status line came back."""

    __slots__ = ("answered", "reused")

    def __init__(self) -> None:
        self.reused = False
        self.answered = False

    def stale(self, exc: BaseException) -> bool:
        """The request failed on a reused connection that the server dropped before answering
        anything (reset, or closed): the keep-alive race, safe to send again."""
        return (
            self.reused
            and not self.answered
            and isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)
            and not isinstance(exc, aiohttp.ClientConnectorError)
        )


async def _on_reuse(_session: aiohttp.ClientSession, ctx: SimpleNamespace, _params: object) -> None:
    if isinstance(ctx.trace_request_ctx, _Attempt):
        ctx.trace_request_ctx.reused = True


_REUSE = aiohttp.TraceConfig()
_REUSE.on_connection_reuseconn.append(_on_reuse)
_REUSE.freeze()


def _upstream_failure(exc: BaseException) -> UpstreamFailure:
    # aiohttp's timeouts are asyncio.TimeoutError, which is TimeoutError.
    return _failure(exc, timeout=TimeoutError, connect=aiohttp.ClientConnectorError)


def _env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url``, as httpx reads it, or None."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname and urllib.request.proxy_bypass(parts.hostname):
        return None
    proxies = urllib.request.getproxies_environment()
    return proxies.get(parts.scheme) or proxies.get("all")


def _failure(
    exc: BaseException, *, timeout: type[BaseException], connect: type[BaseException]
) -> UpstreamFailure:
    """``exc`` (a client's own error) as the failure kind the proxy acts on."""
    kind: FailureKind = (
        "timeout"
        if isinstance(exc, timeout)
        else "connect"
        if isinstance(exc, connect)
        else "transport"
    )
    return UpstreamFailure(kind, str(exc) or f"{type(exc).__name__}: {kind} failure")
