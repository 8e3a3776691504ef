"""Issue 13: an authenticated proxy, bounded resources, no leaked secrets, strict ingest.

One test (or a few) per finding, named after it; storage-touching ones run on SQLite and
Postgres.  The app runs in-process over ``httpx.ASGITransport`` (its lifespan on), the upstream is
an ``httpx.MockTransport`` that records what reached it; the slow-client test runs uvicorn on a
loopback port.  No sleeps: waits are polls with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event
from typer.testing import CliRunner

from api import limits
from api.app import create_app
from api.server import (
    guarded_h11,
    guarded_httptools,
    httptools_available,
    uvicorn_options,
    uvloop_available,
)
from ledger.capability import MIN_SECRET_LEN, mint_capability, rollout_of_capability
from ledger.config import Settings, load_settings, parse_tokens
from ledger.errors import InvalidInput, InvalidRecord
from ledger.ids import is_valid_id
from ledger.records import coerce_entry
from ledger.redact import redact_text, redact_url

Rid = Callable[[str], str]

SECRET = "s" * 8 + "-capture-secret-for-tests-0123456789"
UPSTREAM_KEY = "sk-configured-upstream-key"
TOKENS = (
    "ingest-token-0123456789=ingest;trainer-token-0123456789=trainer;"
    "audit-token-0123456789=audit;admin-token-0123456789=admin"
)
ING = {"Authorization": "Bearer ingest-token-0123456789"}
TRN = {"Authorization": "Bearer trainer-token-0123456789"}
AUD = {"Authorization": "Bearer audit-token-0123456789"}
V1 = "/ledger/v1"
CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}


def record(prompt: list[Any], gen: list[Any], lps: list[Any] | None = None, **over: Any) -> Any:
    out = {
        "model": "smol",
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": lps if lps is not None else [-0.5] * len(gen),
        "created_at": 1700000000.0,
    }
    out.update(over)
    return out


class _Body(httpx.AsyncByteStream):
    """A streamed body, as a real upstream connection gives (pass-through streams it)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


Answer = tuple[int, dict[str, str], Any]


@dataclass
class Upstream:
    """A mock inference server that records each request's path and headers."""

    seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    answers: dict[str, Answer] = field(default_factory=dict)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.method, request.url.path, dict(request.headers)))
        default: Answer = (503, {}, {"error": {"message": "down"}})
        if request.url.path == "/v1/models":
            default = (200, {}, {"object": "list", "data": []})
        status, headers, body = self.answers.get(request.url.path, default)
        data = json.dumps(body).encode() if body is not None else b""
        return httpx.Response(
            status, headers={"content-type": "application/json", **headers}, stream=_Body(data)
        )

    def paths(self, skip_models: bool = True) -> list[str]:
        return [p for _m, p, _h in self.seen if not (skip_models and p == "/v1/models")]


@dataclass
class Api:
    app: FastAPI
    client: httpx.AsyncClient
    upstream: Upstream


@contextlib.asynccontextmanager
async def open_app(
    db_url: str,
    *,
    tokens: str = TOKENS,
    secret: str | None = SECRET,
    upstream_key: str | None = UPSTREAM_KEY,
    upstream_url: str = "http://upstream.test/v1",
    host_header: str = "127.0.0.1",
    **settings_kw: Any,
) -> AsyncIterator[Api]:
    settings = load_settings(db=db_url, upstream=upstream_url, **settings_kw)
    settings.tokens = parse_tokens(tokens)
    settings.capture_secret = secret
    settings.upstream_api_key = upstream_key
    upstream = Upstream()
    app = create_app(settings, upstream_transport=httpx.MockTransport(upstream))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url=f"http://{host_header}", timeout=30
        ) as client,
    ):
        yield Api(app, client, upstream)


async def rollout_exists(api: Api, rollout_id: str, headers: dict[str, str] = AUD) -> bool:
    resp = await api.client.get(f"{V1}/rollouts/{rollout_id}", headers=headers)
    assert resp.status_code in (200, 404), resp.text
    return resp.status_code == 200


def chat_body() -> dict[str, Any]:
    return {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}


# --------------------------------------------------------------------------- 1: proxy auth


def test_capabilities_are_scoped_to_one_rollout_and_one_secret() -> None:
    cap = mint_capability("r-1", SECRET)
    assert rollout_of_capability(cap, SECRET) == "r-1"
    assert rollout_of_capability(cap, SECRET + "x") is None
    forged = cap.replace("r-1", "r-2", 1)
    assert rollout_of_capability(forged, SECRET) is None
    assert rollout_of_capability(cap[:-1] + ("A" if cap[-1] != "A" else "B"), SECRET) is None
    for junk in ("", "rlc1", "rlc1~r-1", "sk-whatever", "rlc1~bad id~x"):
        assert rollout_of_capability(junk, SECRET) is None
    with pytest.raises(InvalidInput, match="at least"):
        mint_capability("r-1", "x" * (MIN_SECRET_LEN - 1))
    with pytest.raises(InvalidInput):
        mint_capability("bad id", SECRET)


async def test_proxy_with_tokens_refuses_writes_without_a_capability(db_url: str, rid: Rid) -> None:
    victim = rid("victim")
    async with open_app(db_url) as api:
        tokenize = f"/ng-rollout/{victim}/training-token-capture/tokenize"
        other_cap = mint_capability(rid("other"), SECRET)
        for headers, status in (
            ({}, 401),
            ({"Authorization": "Bearer sk-anything"}, 401),
            ({"x-api-key": other_cap}, 403),
            ({"Authorization": f"Bearer {other_cap}"}, 403),
            (TRN, 403),  # a token without the ingest scope
        ):
            resp = await api.client.post(tokenize, json={}, headers=headers)
            assert resp.status_code == status, (headers, resp.text)
            chat = await api.client.post(
                f"/ng-rollout/{victim}/training-token-capture{CHAT}",
                json=chat_body(),
                headers=headers,
            )
            assert chat.status_code == status, chat.text
        anthropic = await api.client.post(
            f"/ng-rollout/{victim}/training-token-capture/v1/messages", json={}, headers={}
        )
        assert anthropic.status_code == 401
        assert anthropic.json()["error"]["type"] == "authentication_error"
        assert (await api.client.get("/v1/models")).status_code == 401  # plain pass-through
        assert api.upstream.paths() == []  # nothing reached the model
        assert not await rollout_exists(api, victim)  # nothing was written


async def test_capability_writes_its_rollout_and_the_upstream_gets_the_configured_key(
    db_url: str, rid: Rid
) -> None:
    r = rid("cap")
    cap = mint_capability(r, SECRET)
    async with open_app(db_url) as api:
        for headers in ({"Authorization": f"Bearer {cap}"}, {"x-api-key": cap}):
            resp = await api.client.post(
                f"/ng-rollout/{r}/training-token-capture{CHAT}", json=chat_body(), headers=headers
            )
            assert resp.status_code == 503  # the mock upstream is down; the call was made
        models = await api.client.get("/v1/models", headers={"x-api-key": cap})
        assert models.status_code == 200
        sent = [h for _m, p, h in api.upstream.seen if p in (CHAT, "/v1/models")]
        assert len(sent) >= 3
        for headers in sent:
            assert headers.get("authorization") == f"Bearer {UPSTREAM_KEY}"
            assert "x-api-key" not in headers
            assert cap not in json.dumps(headers)
        # Failed attempts stay open until a retry settles them; freeze records what is left.
        assert (await api.client.post(f"{V1}/rollouts/{r}/freeze", headers=TRN)).status_code == 200
        detail = (await api.client.get(f"{V1}/rollouts/{r}", headers=AUD)).json()
        assert {e["reason"] for e in detail["incomplete_events"]} == {"upstream_error"}


async def test_without_an_upstream_key_no_credential_goes_upstream(db_url: str, rid: Rid) -> None:
    r = rid("nokey")
    async with open_app(db_url, upstream_key=None) as api:
        await api.client.post(
            f"/ng-rollout/{r}/training-token-capture{CHAT}",
            json=chat_body(),
            headers={"Authorization": f"Bearer {mint_capability(r, SECRET)}"},
        )
        (headers,) = [h for _m, p, h in api.upstream.seen if p == CHAT]
        assert "authorization" not in headers and "x-api-key" not in headers


async def test_loopback_mode_without_tokens_forwards_the_harness_key(db_url: str, rid: Rid) -> None:
    async with open_app(db_url, tokens="", secret=None, upstream_key=None) as api:
        resp = await api.client.get("/v1/models", headers={"Authorization": "Bearer sk-harness"})
        assert resp.status_code == 200
        assert api.upstream.seen[-1][2]["authorization"] == "Bearer sk-harness"


# --------------------------------------------------------------------------- 2: /healthz


async def test_healthz_bursts_share_one_pooled_connection(db_url: str) -> None:
    async with open_app(db_url) as api:
        engine = api.app.state.ledger.engine
        connects: list[object] = []

        def on_connect(dbapi_conn: object, _record: object) -> None:
            connects.append(dbapi_conn)

        event.listen(engine.sync_engine, "connect", on_connect)
        health = api.app.state.health
        before = health.db_checks
        answers = await asyncio.gather(*(api.client.get("/healthz") for _ in range(120)))
        assert {a.status_code for a in answers} == {200}
        assert all(a.json()["schema"] == a.json()["head"] for a in answers)
        # Concurrent probes share checks; no probe opens an engine or connection of its own.
        assert health.db_checks - before < 120
        assert len(connects) <= 1
        event.remove(engine.sync_engine, "connect", on_connect)


# --------------------------------------------------------------------------- 3: record size


async def test_records_over_the_token_cap_are_refused(db_url: str, rid: Rid) -> None:
    r = rid("cap")
    async with open_app(db_url, max_record_tokens=1000) as api:
        url = f"{V1}/rollouts/{r}/calls/c1"
        big = await api.client.put(
            url, json={"record": record(list(range(990)), [1] * 11)}, headers=ING
        )
        assert big.status_code == 413, big.text
        assert "1001" in big.json()["error"]["message"]
        assert not await rollout_exists(api, r)
        ok = await api.client.put(
            url, json={"record": record(list(range(990)), [1] * 10)}, headers=ING
        )
        assert ok.status_code == 201, ok.text


async def test_the_token_cap_follows_the_models_context_length(db_url: str, rid: Rid) -> None:
    async with open_app(db_url) as api:
        assert api.app.state.max_record_tokens == limits.DEFAULT_RECORD_TOKENS  # none reported
    models: Answer = (200, {}, {"data": [{"id": "smol", "max_model_len": 512}]})

    settings = load_settings(db=db_url, upstream="http://upstream.test/v1")
    settings.tokens = parse_tokens(TOKENS)
    upstream = Upstream(answers={"/v1/models": models})
    app = create_app(settings, upstream_transport=httpx.MockTransport(upstream))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as c,
    ):
        assert app.state.max_record_tokens == 512
        r = rid("ctx")
        resp = await c.put(
            f"{V1}/rollouts/{r}/calls/c1",
            json={"record": record(list(range(500)), [1] * 13)},
            headers=ING,
        )
        assert resp.status_code == 413


def test_default_body_limit_is_lower() -> None:
    assert Settings().max_body_bytes == 16 * 1024 * 1024


async def test_large_bodies_are_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    real = limits._parse

    def spy(raw: bytes) -> Any:
        threads.append(threading.get_ident())
        return real(raw)

    monkeypatch.setattr(limits, "_parse", spy)
    small = await limits.parse_json_body(b'{"a": [1, 2, 3]}')
    big_raw = json.dumps({"ids": list(range(100_000))}).encode()
    assert len(big_raw) > limits.OFFLOAD_BYTES
    big = await limits.parse_json_body(big_raw)
    assert small == {"a": [1, 2, 3]} and big["ids"][-1] == 99_999
    assert threads[0] == threading.get_ident()  # small: inline
    assert threads[1] != threading.get_ident()  # large: a worker thread


# --------------------------------------------------------------------------- 4: slow clients


# Both guarded protocols: httptools (what `serve` runs when it is installed) and h11.
PROTOCOLS = [
    "h11",
    pytest.param(
        "httptools",
        marks=pytest.mark.skipif(not httptools_available(), reason="httptools not installed"),
    ),
]


def _serve(
    app: Any, settings: Settings, protocol: str | None = None
) -> tuple[Any, threading.Thread, int]:
    import uvicorn

    options = uvicorn_options(settings)
    if protocol is not None:
        guarded = guarded_httptools if protocol == "httptools" else guarded_h11
        options["http"] = guarded(settings.server.header_timeout_s, settings.server.body_timeout_s)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=2,
        **options,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        thread.join(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, port


def _closed_by_server(sock: socket.socket, deadline: float) -> bytes | None:
    """Everything the server sent before closing, or None if it is still open at the deadline."""
    got = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, min(1.0, deadline - time.monotonic())))
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    return None


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_slow_clients_are_cut_off_and_the_service_keeps_answering(
    tmp_path: Path, protocol: str
) -> None:
    from ledger import migrate

    url = f"sqlite+aiosqlite:///{tmp_path / 'slow.db'}"
    migrate.upgrade(url)
    settings = load_settings(db=url)
    settings.server.header_timeout_s = 0.5
    settings.server.body_timeout_s = 0.5
    server, thread, port = _serve(create_app(settings), settings, protocol)
    socks: list[socket.socket] = []
    try:
        for i in range(80):  # never finish the headers
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + str(i).encode())
            socks.append(s)
        for _ in range(10):  # headers, then a body that never completes
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(
                b"POST /ledger/v1/admin/sweep HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"older'
            )
            socks.append(s)
        keep = socket.create_connection(("127.0.0.1", port), timeout=5)  # one good request,
        keep.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = keep.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:100]
        keep.sendall(b"GET /healthz HTTP/1.1\r\nHost: 1")  # then a stalled second one
        socks.append(keep)
        deadline = time.monotonic() + 30
        answers = [_closed_by_server(s, deadline) for s in socks]
        assert all(a is not None for a in answers), "a slow connection was held open"
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers[:80] if a)
        assert sum(bool(a) for a in answers[:80]) >= 70  # the 408 reached (almost) everyone
        ok = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert ok.status_code == 200
    finally:
        for s in socks:
            s.close()
        server.should_exit = True
        thread.join(10)


def _one_answer(sock: socket.socket) -> bytes:
    """One whole HTTP answer (head and a content-length body) from a kept-alive connection."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, got
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_oversized_request_head_is_refused_and_a_kept_alive_one_still_served(
    tmp_path: Path, protocol: str
) -> None:
    from ledger import migrate

    url = f"sqlite+aiosqlite:///{tmp_path / 'head.db'}"
    migrate.upgrade(url)
    settings = load_settings(db=url)
    settings.server.header_timeout_s = 0.5
    server, thread, port = _serve(create_app(settings), settings, protocol)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            filler = b"X-Filler: " + b"a" * 1000 + b"\r\n"
            # An endless head (never finished) is cut off at the size cap, before its deadline.
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + filler * 40)
            got = _closed_by_server(s, time.monotonic() + 20)
        assert got is not None and got.startswith(b"HTTP/1.1 400"), got
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            # Keep-alive: idling between requests longer than the header deadline (but inside
            # the keep-alive timeout) is not a slow request; each one gets its answer.
            for _ in range(3):
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + filler * 4 + b"\r\n")
                head = _one_answer(s)
                assert head.startswith(b"HTTP/1.1 200"), head[:100]
                time.sleep(0.8)
    finally:
        server.should_exit = True
        thread.join(10)


def test_serve_passes_the_connection_limits_to_uvicorn() -> None:
    settings = Settings()
    opts = uvicorn_options(settings)
    assert opts["limit_concurrency"] == settings.server.max_connections
    assert opts["timeout_keep_alive"] == settings.server.keep_alive_s
    assert opts["http"].header_timeout_s == settings.server.header_timeout_s
    assert opts["loop"] == ("uvloop" if uvloop_available() else "asyncio")
    if httptools_available():  # the C parser when it is installed
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        assert issubclass(opts["http"], HttpToolsProtocol)


# How long Rust's reqwest (hyper's pool) keeps an idle connection unless told otherwise: the
# documented default of ``ClientBuilder::pool_idle_timeout``.  The Codex CLI builds its client
# with ``reqwest::Client::builder()`` and leaves it so.
REQWEST_POOL_IDLE_S = 90.0


async def test_serve_outlasts_the_idle_pools_of_its_clients() -> None:
    """A client that sends on a pooled connection while the server closes it as idle gets a
    reset, not an answer (160 concurrent rollouts through httpx, whose pool keeps idle
    connections 5 s, as serve then did: 4 of 5,760 calls failed so).  So serve keeps idle
    connections longer than its clients' pools do: httpx (the OpenAI and Anthropic SDKs),
    aiohttp, NeMo Gym's own client, which sets its pool's keep-alive itself, and the Codex
    CLI, whose client keeps reqwest's default (hyper's pool: idle connections kept 90 s; not
    reachable from Python, so its documented value)."""
    import re

    import aiohttp

    from tests.support import nemo_gym_release

    keep = Settings().server.keep_alive_s
    assert keep > httpx.Limits().keepalive_expiry
    assert keep > REQWEST_POOL_IDLE_S
    connector = aiohttp.TCPConnector()
    try:
        assert keep > connector._keepalive_timeout
    finally:
        await connector.close()
    root = nemo_gym_release._extracted()
    if root is None:
        assert not nemo_gym_release.REQUIRED, nemo_gym_release.missing_reason()
        return
    source = (root / "nemo_gym" / "server_utils.py").read_text()
    gym = re.findall(r"keepalive_timeout=([0-9.]+)", source)
    assert gym, "NeMo Gym's client no longer sets its pool's keep-alive where it did"
    assert all(keep > float(value) for value in gym), gym


# --------------------------------------------------------------------------- 5: CORS, Host


async def test_nothing_under_ledger_is_forwarded_upstream(db_url: str) -> None:
    async with open_app(db_url) as api:
        for method, path in (
            ("OPTIONS", f"{V1}/rollouts/x"),
            ("GET", f"{V1}/stats/"),
            ("GET", "/LEDGER/v1/stats"),
            ("GET", "/Ledger/V1/rollouts"),
            ("DELETE", f"{V1}/rollouts/x/"),
            ("GET", "/ledger"),
            ("GET", "/healthz/"),
        ):
            resp = await api.client.request(
                method, path, headers={**AUD, "Origin": "http://evil.example"}
            )
            assert resp.status_code == 404, (method, path, resp.text)
            assert "access-control-allow-origin" not in resp.headers
        assert api.upstream.paths() == []  # and so the ledger token never left


async def test_no_token_mode_refuses_other_hosts_origins_and_form_posts(
    db_url: str, rid: Rid
) -> None:
    r = rid("csrf")
    async with open_app(db_url, tokens="", secret=None) as api:
        put = await api.client.put(f"{V1}/rollouts/{r}/calls/c1", json={"record": record([1], [2])})
        assert put.status_code == 201, put.text
        freeze = f"{V1}/rollouts/{r}/freeze"
        # DNS rebinding: the page's own host name reaches the loopback service.
        rebound = await api.client.post(freeze, headers={**JSON, "Host": "evil.example"})
        assert rebound.status_code == 421
        listed = await api.client.get(f"{V1}/rollouts", headers={"Host": "evil.example"})
        assert listed.status_code == 421  # reads too: the page would see the answer
        probe = await api.client.get("/healthz", headers={"Host": "10.0.0.5:8080"})
        assert probe.status_code == 200  # probes reach the service by any address
        cross = await api.client.post(freeze, headers={**JSON, "Origin": "http://evil.example"})
        assert cross.status_code == 403
        for headers in (
            {},
            {"content-type": "text/plain"},
            {"content-type": "multipart/form-data"},
        ):
            resp = await api.client.post(freeze, headers=headers)
            assert resp.status_code == 415, resp.text
        delete = await api.client.delete(f"{V1}/rollouts/{r}")
        assert delete.status_code == 415
        state = (await api.client.get(f"{V1}/rollouts/{r}")).json()
        assert state["rollout"]["state"] == "open"  # nothing was frozen or deleted
        ok = await api.client.post(freeze, headers={**JSON, "Origin": "http://localhost:3000"})
        assert ok.status_code == 200
        # The Python client sends the content type, so it keeps working in this mode.
        from ledger.client import RemoteLedger

        remote = RemoteLedger("http://127.0.0.1", transport=httpx.ASGITransport(api.app), retries=0)
        try:
            assert await remote.delete_rollout(r) is True
        finally:
            await remote.close()


async def test_allowed_hosts_extend_the_no_token_mode(db_url: str) -> None:
    async with open_app(
        db_url,
        tokens="",
        secret=None,
        host_header="ledger.internal:8080",
        auth={"allowed_hosts": ["ledger.internal"]},
    ) as api:
        assert (await api.client.get(f"{V1}/stats")).status_code == 200


# --------------------------------------------------------------------------- 6: secrets


def test_redaction_masks_url_passwords_and_secret_parameters() -> None:
    assert redact_url("postgresql://app:hunter2@db:5432/l") == "postgresql://app:***@db:5432/l"
    assert redact_url("http://tok@vllm:8000/v1") == "http://***@vllm:8000/v1"
    assert redact_url("http://vllm:8000/v1") == "http://vllm:8000/v1"
    text = "cannot connect to postgresql+asyncpg://u:p%40ss@h/db?password=x&sslmode=require"
    clean = redact_text(text)
    assert "p%40ss" not in clean and "password=x" not in clean and "sslmode=require" in clean


async def test_upstream_credentials_stay_out_of_healthz_and_logs(
    db_url: str, rid: Rid, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with open_app(
        db_url,
        tokens="",
        secret=None,
        upstream_key=None,
        upstream_url="http://user:upstream-pw-123@upstream.test/v1",
    ) as api:
        health = (await api.client.get("/healthz")).json()
        assert "upstream-pw-123" not in json.dumps(health)
        assert health["upstream"] == "http://user:***@upstream.test"
        await api.client.post(
            f"/ng-rollout/{rid('log')}/training-token-capture{CHAT}", json=chat_body()
        )
        assert any(p == CHAT for _m, p, _h in api.upstream.seen)
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("upstream.test" in m for m in messages)  # httpx did log its request lines
    assert not any("upstream-pw-123" in m for m in messages)


def test_serve_banner_and_errors_hide_the_database_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uvicorn

    from api.cli import app

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("must not serve"))
    for var in ("ROLLOUT_LEDGER_TOKENS", "ROLLOUT_LEDGER_DB", "ROLLOUT_LEDGER_HOST"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(
        app, ["serve", "--db", "postgresql://ledger:db-pw-456@127.0.0.1:9/ledger"]
    )
    assert result.exit_code == 1
    assert "db-pw-456" not in result.output
    assert "ledger:***@127.0.0.1" in " ".join(result.output.split())


def test_serve_refuses_short_tokens_and_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from api.cli import app

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("must not serve"))
    short = CliRunner().invoke(app, ["serve"], env={"ROLLOUT_LEDGER_TOKENS": "abc=admin"})
    assert short.exit_code == 2 and "shorter than 16" in " ".join(short.output.split())
    weak = CliRunner().invoke(
        app,
        ["serve"],
        env={"ROLLOUT_LEDGER_TOKENS": TOKENS, "ROLLOUT_LEDGER_CAPTURE_SECRET": "short"},
    )
    assert weak.exit_code == 2 and "capture secret" in weak.output


# --------------------------------------------------------------------------- 7: strict ingest


BAD_RECORDS = [
    ("+Infinity log-prob literal", record([1], [2], [math.inf])),
    ("positive log-prob", record([1], [2], [0.5])),
    ("Infinity string", record([1], [2], ["Infinity"])),
    ("NaN string", record([1], [2], ["NaN"])),
    ("number as string", record([1], [2], ["-0.5"])),
    ("bool log-prob", record([1], [2], [False])),
    ("negative id", record([-1], [2])),
    ("bool id", record([True], [2])),
    ("string id", record(["7"], [2])),
    ("float id", record([7.0], [2])),
    ("id beyond int32", record([1], [2**31])),
    ("created_at 1e308", record([1], [2], created_at=1e308)),
    ("negative created_at", record([1], [2], created_at=-1.0)),
    ("bool created_at", record([1], [2], created_at=True)),
    ("string created_at", record([1], [2], created_at="1700000000")),
]


async def test_ingest_refuses_what_the_extractor_refuses(db_url: str, rid: Rid) -> None:
    async with open_app(db_url) as api:
        for name, bad in BAD_RECORDS:
            r = rid("strict")
            body = json.dumps({"record": bad}, allow_nan=True)  # +inf as the literal Infinity
            resp = await api.client.put(
                f"{V1}/rollouts/{r}/calls/c1", content=body, headers={**ING, **JSON}
            )
            assert resp.status_code == 422, (name, resp.text)
            assert resp.headers["content-type"] == "application/json"
            assert not await rollout_exists(api, r), name
        r = rid("ok")
        good = record([0, 1, 2**31 - 1], [2, 3], ["-Infinity", -0.0], created_at=0)
        resp = await api.client.put(
            f"{V1}/rollouts/{r}/calls/c1", json={"record": good}, headers=ING
        )
        assert resp.status_code == 201, resp.text


def test_python_callers_get_the_same_rules() -> None:
    ids = {"rollout_id": "r1", "model_call_id": "c1"}
    for name, bad in BAD_RECORDS:
        with pytest.raises(InvalidRecord):
            coerce_entry({**bad, **ids})
            pytest.fail(name)
    entry = coerce_entry({**record([1], [2], [-math.inf]), **ids})
    assert entry.generation_log_probs == [-math.inf]


def test_the_extractor_refuses_positive_log_probs() -> None:
    from api.extract import MalformedTokenPayload, extract_chat_tokens

    answer: dict[str, Any] = {
        "id": "chatcmpl-1",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "token_ids": [5],
                "logprobs": {"content": [{"token": "token_id:5", "logprob": 0.25}]},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1},
    }
    with pytest.raises(MalformedTokenPayload, match="not a log-probability"):
        extract_chat_tokens(answer)
    answer["choices"][0]["logprobs"]["content"][0]["logprob"] = -0.25
    assert extract_chat_tokens(answer).generation_log_probs == [-0.25]


# --------------------------------------------------------------------------- 8: lower


async def test_dot_segments_never_escape_the_upstream_base_path(db_url: str) -> None:
    async with open_app(db_url, tokens="", secret=None) as api:
        for path in (
            "/v1/%2e%2e/admin",
            "/%2E%2E/admin",
            "/v1/%2e%2e/%2e%2e/x",
            "/v1/%2e/models",
            "/ng-rollout/r1/training-token-capture/v1/%2e%2e/%2e%2e/admin",
        ):
            resp = await api.client.get(path)
            assert resp.status_code == 400, (path, resp.text)
        assert api.upstream.paths() == []


async def test_caller_chosen_reasons_are_counted_as_other(db_url: str, rid: Rid) -> None:
    async with open_app(db_url) as api:
        for i in range(5):
            resp = await api.client.post(
                f"{V1}/rollouts/{rid('lbl')}/incomplete",
                json={"reason": f"attacker_label_{i}"},
                headers=ING,
            )
            assert resp.status_code == 200, resp.text
        text = (await api.client.get("/metrics")).text
        assert "attacker_label" not in text
        assert 'rollout_ledger_incomplete_marks_total{reason="other"} 5.0' in text


async def test_surrogates_and_deep_nesting_get_a_json_422(db_url: str, rid: Rid) -> None:
    async with open_app(db_url) as api:
        base = json.dumps(record([1], [2]))[:-1]
        deep = "[" * 300 + "]" * 300
        bodies = [
            '{"record":' + base + ',"output_items":[{"\\ud800":1}]}}',
            '{"record":' + base + ',"routed_experts":{"\\udfff":1}}}',
            '{"record":' + base + ',"deep":' + deep + "}}",
            '{"record":' + base + ',"deep":' + "[" * 5000 + "]" * 5000 + "}}",
        ]
        for body in bodies:
            r = rid("sur")
            resp = await api.client.put(
                f"{V1}/rollouts/{r}/calls/c1", content=body, headers={**ING, **JSON}
            )
            assert resp.status_code == 422, resp.text[:300]
            assert resp.json()["error"]["code"] == "invalid_request"
            assert not await rollout_exists(api, r)
        for body in ('{"result": {"response": {"\\ud800": 1}}}', '{"result": {"x": ' + deep + "}}"):
            resp = await api.client.post(f"{V1}/finalize", content=body, headers={**TRN, **JSON})
            assert resp.status_code == 422, resp.text[:300]


async def test_a_trailing_newline_is_not_part_of_an_id(db_url: str) -> None:
    assert not is_valid_id("nl-1\n")
    async with open_app(db_url, tokens="", secret=None) as api:
        put = await api.client.put(
            f"{V1}/rollouts/nl-1%0A/calls/c1", json={"record": record([1], [2])}
        )
        assert put.status_code == 422
        proxied = await api.client.post(
            f"/ng-rollout/nl-1%0A/training-token-capture{CHAT}", json=chat_body()
        )
        assert proxied.status_code in (400, 404)  # never forwarded, never recorded
        assert api.upstream.paths() == []


async def listed_since(api: Api, since: str) -> set[str]:
    """Every rollout id ``GET /rollouts?since=`` lists (all pages; the database is shared)."""
    found: set[str] = set()
    params: dict[str, Any] = {"since": since, "limit": 1000}
    for _ in range(1000):
        page = await api.client.get(f"{V1}/rollouts", params=params)
        assert page.status_code == 200, page.text
        found |= {i["rollout_id"] for i in page.json()["items"]}
        if page.json()["next_cursor"] is None:
            return found
        params["cursor"] = page.json()["next_cursor"]
    raise AssertionError("more than 1000 pages")


async def test_since_honours_the_offset(db_url: str, rid: Rid) -> None:
    async with open_app(db_url, tokens="", secret=None) as api:
        r = rid("since")
        resp = await api.client.put(
            f"{V1}/rollouts/{r}/calls/c1", json={"record": record([1], [2])}
        )
        assert resp.status_code == 201
        now = datetime.now(UTC)
        east, west = timezone(timedelta(hours=2)), timezone(timedelta(hours=-5))
        earlier = (now - timedelta(minutes=30)).astimezone(east).isoformat()
        later = (now + timedelta(minutes=30)).astimezone(west).isoformat()

        assert r in await listed_since(api, earlier)
        assert r not in await listed_since(api, later)
        stats = await api.client.get(f"{V1}/stats", params={"since": later})
        assert stats.status_code == 200


async def test_a_preflight_on_a_training_route_is_answered_here(db_url: str, rid: Rid) -> None:
    r = rid("pre")
    async with open_app(db_url, tokens="", secret=None) as api:
        resp = await api.client.options(
            f"/ng-rollout/{r}/training-token-capture{CHAT}",
            headers={"Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST"},
        )
        assert resp.status_code == 204
        assert "access-control-allow-origin" not in resp.headers
        assert api.upstream.paths() == []
        assert not await rollout_exists(api, r, headers={})


async def test_upstream_redirects_do_not_reveal_its_address(db_url: str) -> None:
    async with open_app(
        db_url, tokens="", secret=None, upstream_url="http://vllm.internal:8000/v1"
    ) as api:
        api.upstream.answers["/v1/old"] = (
            302,
            {"location": "http://vllm.internal:8000/v1/new?x=1"},
            None,
        )
        api.upstream.answers["/v1/away"] = (307, {"location": "http://10.0.0.7:9000/secret"}, None)
        old = await api.client.get("/v1/old", follow_redirects=False)
        assert old.status_code == 302 and old.headers["location"] == "/v1/new?x=1"
        away = await api.client.get("/v1/away", follow_redirects=False)
        assert away.status_code == 307 and "location" not in away.headers


async def test_an_over_limit_chunked_body_is_a_413(db_url: str, rid: Rid) -> None:
    async with open_app(db_url, max_body_bytes=64 * 1024) as api:

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"record": {"prompt_token_ids": ['
            for _ in range(64):
                yield b"1," * 1024
            yield b"1]}}"

        r = rid("chunk")
        put = await api.client.put(
            f"{V1}/rollouts/{r}/calls/c1", content=chunks(), headers={**ING, **JSON}
        )
        assert put.status_code == 413, put.text[:200]
        proxied = await api.client.post(
            f"/ng-rollout/{r}/training-token-capture{CHAT}",
            content=chunks(),
            headers={**ING, **JSON},
        )
        assert proxied.status_code == 413, proxied.text[:200]
        passed = await api.client.post("/v1/embeddings", content=chunks(), headers={**ING, **JSON})
        assert passed.status_code == 413, passed.text[:200]
        assert api.upstream.paths() == []


def test_the_cli_mints_the_same_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    from api.cli import app

    monkeypatch.setenv("ROLLOUT_LEDGER_CAPTURE_SECRET", SECRET)
    minted = CliRunner().invoke(app, ["mint-capability", "r-7"])
    assert minted.exit_code == 0, minted.output
    assert rollout_of_capability(minted.output.strip(), SECRET) == "r-7"
    monkeypatch.delenv("ROLLOUT_LEDGER_CAPTURE_SECRET")
    missing = CliRunner().invoke(app, ["mint-capability", "r-7"])
    assert missing.exit_code == 2 and "ROLLOUT_LEDGER_CAPTURE_SECRET" in missing.output


async def test_a_large_snapshot_is_encoded_exactly(db_url: str, rid: Rid) -> None:
    r = rid("bigfreeze")
    prompt = [(i * 7919) % 50000 for i in range(limits.OFFLOAD_TOKENS + 10)]
    async with open_app(db_url) as api:
        put = await api.client.put(
            f"{V1}/rollouts/{r}/calls/c1",
            json={"record": record(prompt, [5, 6], ["-Infinity", -0.25])},
            headers=ING,
        )
        assert put.status_code == 201, put.text[:200]
        frozen = await api.client.post(f"{V1}/rollouts/{r}/freeze", headers=TRN)
        assert frozen.status_code == 200
        (entry,) = frozen.json()["entries"]
        assert entry["prompt_token_ids"] == prompt
        assert entry["generation_log_probs"] == ["-Infinity", -0.25]


def test_real_sdks_use_a_capability_as_their_api_key(
    db_url: str, rid: Rid, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The released OpenAI and Anthropic SDKs carry the capability (``~`` and all) as their
    API key; a capability for another rollout is an authentication error they understand."""
    import anthropic
    import openai

    from tests.proxy_support import start_stack

    monkeypatch.setenv("ROLLOUT_LEDGER_TOKENS", TOKENS)
    monkeypatch.setenv("ROLLOUT_LEDGER_CAPTURE_SECRET", SECRET)
    with contextlib.contextmanager(start_stack)(db_url) as stack:
        r = rid("sdk")
        key = mint_capability(r, SECRET)
        client = openai.OpenAI(base_url=stack.base(r) + "/v1", api_key=key, max_retries=0)
        msgs: Any = [{"role": "user", "content": "hi"}]
        client.chat.completions.create(model="smol", messages=msgs)
        claude = anthropic.Anthropic(base_url=stack.base(r), api_key=key, max_retries=0)
        claude.messages.create(model="smol", max_tokens=32, messages=msgs)
        assert stack.captured(r) == 2
        stranger = openai.OpenAI(
            base_url=stack.base(r) + "/v1", api_key=mint_capability(rid("x"), SECRET), max_retries=0
        )
        with pytest.raises(openai.PermissionDeniedError):
            stranger.chat.completions.create(model="smol", messages=msgs)
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(
                base_url=stack.base(r), api_key="sk-guess", max_retries=0
            ).messages.create(model="smol", max_tokens=32, messages=msgs)
        assert stack.captured(r) == 2
