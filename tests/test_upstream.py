"""The proxy's generating POST (``api.upstream``): both clients, against real sockets.

aiohttp carries the generating POST in serving; httpx carries it when a test injects a
transport.  The proxy's behaviour on a failure depends only on the failure's kind (a refused
connection is retried once; a timeout and a broken transport are answered as the dialect's
transport error), so both clients must name the same failures the same way.  Each case here is
a real loopback server (or a real closed port), not a mocked exception.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from api.upstream import AiohttpPoster, HttpxPoster, UpstreamFailure, UpstreamPoster
from tests.support.net import free_port, read_request, reset

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Seen = list[tuple[bytes, dict[str, str], bytes]]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[str]:
    srv = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        for writer in list(_writers):
            writer.close()
        _writers.clear()


_writers: list[asyncio.StreamWriter] = []


def answering(seen: Seen, status: int = 200, body: bytes = b'{"ok":true}') -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    return handle


async def hanging(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    _writers.append(writer)
    await read_request(reader)
    await asyncio.sleep(30)


def closing(seen: Seen) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.close()  # the request was read; no answer, the connection ends

    return handle


def closing_when_reused(seen: Seen, connections: list[int]) -> Handler:
    """Answers the first request on each connection and keeps the connection open; the next
    request on that same connection is read and the connection reset without an answer: what
    a client meets when it reuses a connection the server closed as idle just as the request
    went out (a keep-alive race)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(seen))
        seen.append(await read_request(reader))
        body = b'{"ok":true}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        seen.append(await read_request(reader))
        reset(writer)  # an RST, not an answer

    return handle


def poster(
    kind: str, base: str, *, timeout_s: float = 5.0, auth: tuple[str, str] | None = None
) -> UpstreamPoster:
    if kind == "aiohttp":
        return AiohttpPoster(base, timeout_s=timeout_s, connect_timeout_s=2.0, basic_auth=auth)
    client = httpx.AsyncClient(
        base_url=base,
        timeout=httpx.Timeout(timeout_s, connect=2.0),
        auth=httpx.BasicAuth(*auth) if auth else None,
    )
    return _OwningHttpx(client)


class _OwningHttpx(HttpxPoster):
    def __init__(self, client: httpx.AsyncClient) -> None:
        super().__init__(client)
        self.client = client

    async def aclose(self) -> None:
        await self.client.aclose()


KINDS = ["aiohttp", "httpx"]


@pytest.mark.parametrize("kind", KINDS)
async def test_the_answer_comes_back_with_the_base_path_and_headers(kind: str) -> None:
    seen: Seen = []
    body = b'{"choices":[],"n":' + b"7" * 100_000 + b"}"
    async with server(answering(seen, 200, body)) as url:
        p = poster(kind, url + "/v1")
        try:
            answer = await p.post("/chat/completions", b'{"a":1}', {"x-request-id": "r1"})
        finally:
            await p.aclose()
    assert (answer.status, answer.body) == (200, body)
    line, headers, sent = seen[0]
    assert line.startswith(b"POST /v1/chat/completions ")
    assert headers["x-request-id"] == "r1"
    assert sent == b'{"a":1}'


@pytest.mark.parametrize("kind", KINDS)
async def test_an_error_status_is_an_answer_not_a_failure(kind: str) -> None:
    seen: Seen = []
    async with server(answering(seen, 503, b'{"error":"busy"}')) as url:
        p = poster(kind, url)
        try:
            answer = await p.post("/v1/completions", b"{}", {})
        finally:
            await p.aclose()
    assert (answer.status, answer.body) == (503, b'{"error":"busy"}')


@pytest.mark.parametrize("kind", KINDS)
async def test_url_credentials_replace_the_harness_authorization(kind: str) -> None:
    seen: Seen = []
    async with server(answering(seen)) as url:
        p = poster(kind, url, auth=("user", "pw"))
        try:
            await p.post("/x", b"{}", {"authorization": "Bearer harness-key"})
        finally:
            await p.aclose()
    expected = "Basic " + base64.b64encode(b"user:pw").decode()
    assert seen[0][1]["authorization"] == expected


async def failure_of(p: UpstreamPoster) -> UpstreamFailure:
    """The failure a generating POST through ``p`` raises (``p`` is closed after)."""
    try:
        with pytest.raises(UpstreamFailure) as failed:
            await p.post("/v1/chat/completions", b"{}", {})
    finally:
        await p.aclose()
    assert str(failed.value)  # the harness's error message says something
    return failed.value


@pytest.mark.parametrize("kind", KINDS)
async def test_a_closed_port_is_a_refused_connection(kind: str) -> None:
    failure = await failure_of(poster(kind, f"http://127.0.0.1:{free_port()}"))
    assert failure.kind == "connect"


@pytest.mark.parametrize("kind", KINDS)
async def test_an_upstream_that_never_answers_times_out(kind: str) -> None:
    async with server(hanging) as url:
        failure = await failure_of(poster(kind, url, timeout_s=0.3))
    assert failure.kind == "timeout"


@pytest.mark.parametrize("kind", KINDS)
async def test_a_connection_closed_before_the_answer_is_a_transport_failure(kind: str) -> None:
    """A new connection that ends without an answer: the engine may have taken the request, so
    it is not sent again here (the harness's own retry decides)."""
    seen: Seen = []
    async with server(closing(seen)) as url:
        failure = await failure_of(poster(kind, url))
    assert failure.kind == "transport"
    assert len(seen) == 1


async def test_a_reused_connection_reset_before_any_answer_is_retried_on_a_new_one() -> None:
    """The keep-alive race: a pooled connection the server drops as the request goes out.  The
    request never reached the engine's handler, so aiohttp's poster sends it once more, on a
    new connection, and the call gets its answer instead of a 502."""
    seen: Seen = []
    connections: list[int] = []
    resent: list[None] = []
    async with server(closing_when_reused(seen, connections)) as url:
        p = AiohttpPoster(
            url, timeout_s=5, connect_timeout_s=2, on_resend=lambda: resent.append(None)
        )
        try:
            first = await p.post("/v1/chat/completions", b'{"n":1}', {})
            second = await p.post("/v1/chat/completions", b'{"n":2}', {})
        finally:
            await p.aclose()
    assert (first.status, second.status) == (200, 200)
    assert [body for _line, _headers, body in seen] == [b'{"n":1}', b'{"n":2}', b'{"n":2}']
    assert connections == [0, 2]  # the retry came on a connection of its own
    assert len(resent) == 1  # counted (``upstream_retries_total``)


def test_the_pool_drops_idle_connections_before_an_engines_server_does() -> None:
    """uvicorn (vLLM's and SGLang's HTTP server) closes a connection idle for its keep-alive
    timeout; the proxy's pool lets go of one sooner, so it does not pick one being closed."""
    import uvicorn

    from api.upstream import POOL_IDLE_S

    assert uvicorn.Config(app=None).timeout_keep_alive > POOL_IDLE_S


def test_the_apps_httpx_pool_drops_idle_connections_as_soon(db_url: str) -> None:
    """The app's httpx client (pass-through routes, ``/tokenize``, prefix supply) keeps idle
    connections no longer than the generating POST's pool does."""
    from api.app import create_app
    from api.upstream import POOL_IDLE_S
    from ledger.config import load_settings
    from rollout_sim import ThreadedServer

    app = create_app(load_settings(db=db_url, upstream=f"http://127.0.0.1:{free_port()}/v1"))
    with ThreadedServer(app, lifespan="on", startup_timeout=60):
        pool = app.state.upstream._transport._pool
        assert pool._keepalive_expiry == POOL_IDLE_S


async def test_a_reused_connection_is_retried_once_only() -> None:
    """A retry that fails too is the call's transport failure: one retry, no loop."""
    seen: Seen = []

    async def answer_once_then_reset(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if seen:  # every later connection: read and reset
            seen.append(await read_request(reader))
            reset(writer)
            return
        await closing_when_reused(seen, [])(reader, writer)

    async with server(answer_once_then_reset) as url:
        p = poster("aiohttp", url)
        try:
            await p.post("/v1/chat/completions", b"{}", {})
            with pytest.raises(UpstreamFailure) as failed:
                await p.post("/v1/chat/completions", b"{}", {})
        finally:
            await p.aclose()
    assert failed.value.kind == "transport"
    assert len(seen) == 3  # the first answer, the reused connection's request, one retry


def test_serving_proxy_retries_a_refused_connection_once_over_aiohttp(
    db_url: str, rid: Callable[[str], str]
) -> None:
    """The app as ``serve`` builds it (no injected transport): the generating POST goes over
    aiohttp; a refused connection is retried once, then answered as the dialect's 502, and the
    intent stays open for a retry of the harness to settle."""
    from api.app import create_app
    from ledger.config import load_settings
    from rollout_sim import ThreadedServer

    settings = load_settings(db=db_url, upstream=f"http://127.0.0.1:{free_port()}/v1")
    app = create_app(settings)
    with ThreadedServer(app, lifespan="on", startup_timeout=60) as proxy:
        assert isinstance(app.state.upstream_post, AiohttpPoster)
        r = rid("refused-aiohttp")
        base = f"{proxy.url}/ng-rollout/{r}/training-token-capture"
        resp = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "smol", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        metrics = httpx.get(proxy.url + "/metrics").text
        detail = httpx.get(f"{proxy.url}/ledger/v1/rollouts/{r}").json()
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["code"] == "upstream_unavailable"
    assert "rollout_ledger_upstream_retries_total 1.0" in metrics
    assert [c["status"] for c in detail["calls"]] == ["intent"]


async def test_aiohttp_goes_through_the_proxy_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``HTTP_PROXY`` is honoured as httpx honours it (a forward proxy gets the absolute URL),
    and ``NO_PROXY`` exempts the upstream's host."""
    seen: Seen = []
    async with server(answering(seen)) as proxy_url:
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        monkeypatch.setenv("NO_PROXY", "exempt.invalid")
        p = AiohttpPoster("http://upstream.invalid:8000/v1", timeout_s=5, connect_timeout_s=2)
        try:
            answer = await p.post("/chat/completions", b"{}", {})
        finally:
            await p.aclose()
        assert answer.status == 200
        assert seen[0][0].startswith(b"POST http://upstream.invalid:8000/v1/chat/completions ")
        monkeypatch.setenv("NO_PROXY", "upstream.invalid")
        exempt = AiohttpPoster("http://upstream.invalid:8000/v1", timeout_s=5, connect_timeout_s=2)
        try:
            with pytest.raises(UpstreamFailure) as failed:  # no such host: not via the proxy
                await exempt.post("/chat/completions", b"{}", {})
        finally:
            await exempt.aclose()
        assert failed.value.kind == "connect"
        assert len(seen) == 1
