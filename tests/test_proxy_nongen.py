"""Issue #6 point 6: non-generating requests on a training-capture route.

An unrecognised route answered 404/405 is harmless; an exact (method, path) declared
non-generating passes when it succeeds (the defaults: GET /v1/models, POST /tokenize,
POST /detokenize, GET /health, GET /version, HEAD/GET /api/hello); any other outcome fails
closed: the rollout is incomplete with reason `unrecognized_route`.  Invalid declarations are
refused at startup, naming the bad entry.  count_tokens is answered by the proxy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from typer.testing import CliRunner

from api.cli import app as cli_app
from ledger.config import ConfigError, load_settings
from rollout_sim import ByteTokenizer, SimEngine
from tests.proxy_support import Stack, reset, start_stack

Rid = Callable[[str], str]
DECLARED_EXTRA = {"method": "GET", "path": "/v1/extra"}


def _side_routes(engine: SimEngine) -> None:
    """Routes a real upstream might have that the simulator lacks; their answers are 2xx
    (or 3xx/5xx) text the proxy cannot prove harmless unless declared."""

    async def hello(request: Request) -> Response:
        return Response(status_code=200)

    async def leaky(request: Request) -> Response:
        return JSONResponse({"text": "policy-generated text could hide here"})

    async def moved(request: Request) -> Response:
        return RedirectResponse("/v1/models", status_code=307)

    async def broken(request: Request) -> Response:
        return PlainTextResponse("upstream exploded", status_code=500)

    engine.app.add_route("/api/hello", hello, methods=["GET", "HEAD"])
    engine.app.add_route("/v1/extra", leaky, methods=["GET"])
    engine.app.add_route("/v1/leaky", leaky, methods=["GET", "POST"])
    engine.app.add_route("/v1/moved", moved, methods=["GET"])
    engine.app.add_route("/v1/broken", broken, methods=["GET"])


@pytest.fixture(scope="module")
def _side_stack(session_db_url: str) -> Iterator[Stack]:
    engine = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=16384, seed=2)
    _side_routes(engine)
    yield from start_stack(
        session_db_url, engine=engine, token_id_capture_non_generating_requests=[DECLARED_EXTRA]
    )


@pytest.fixture
def side_stack(_side_stack: Stack) -> Stack:
    return reset(_side_stack)


def call(stack: Stack, rollout_id: str, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, stack.base(rollout_id) + path, **kw)


def test_declared_routes_pass(side_stack: Stack, rid: Rid) -> None:
    stack, r = side_stack, rid("decl")
    answers = [
        call(stack, r, "GET", "/v1/models?limit=1000"),
        call(stack, r, "POST", "/tokenize", json={"model": "smol", "prompt": "hello"}),
        call(stack, r, "POST", "/detokenize", json={"model": "smol", "tokens": [120, 121]}),
        call(stack, r, "GET", "/health"),
        call(stack, r, "GET", "/version"),
        call(stack, r, "HEAD", "/api/hello"),
        call(stack, r, "GET", "/api/hello"),
        call(stack, r, "GET", "/v1/extra"),  # declared in config
    ]
    assert [a.status_code for a in answers] == [200] * len(answers)
    assert answers[0].json()["data"][0]["id"] == "smol"
    assert answers[1].json()["count"] == 5
    assert answers[2].json() == {"prompt": "hi"}
    seen = [(q.method, q.path, q.query) for q in stack.engine.requests]
    assert seen == [
        ("GET", "/v1/models", "limit=1000"),  # query strings pass through
        ("POST", "/tokenize", ""),
        ("POST", "/detokenize", ""),
        ("GET", "/health", ""),
        ("GET", "/version", ""),
    ]  # (the test's own side routes do not record)
    info = stack.detail(r)
    assert info is None or info["incomplete_events"] == []


def test_404_and_405_are_harmless(side_stack: Stack, rid: Rid) -> None:
    stack, r = side_stack, rid("miss")
    assert call(stack, r, "GET", "/v1/nothing-here").status_code == 404
    assert call(stack, r, "DELETE", "/v1/models").status_code == 405
    assert call(stack, r, "GET", "/v1/chat/completions").status_code == 405  # not a POST
    assert call(stack, r, "PUT", "/tokenize", json={}).status_code == 405
    info = stack.detail(r)
    assert info is None or info["incomplete_events"] == []


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/leaky", 200),  # undeclared 2xx: could carry policy text
        ("POST", "/v1/leaky", 200),  # the method is part of the declaration
        ("GET", "/v1/moved", 307),
        ("GET", "/v1/broken", 500),
        ("POST", "/v1/extra", 405),  # declared only for GET, and harmless as a 405
    ],
)
def test_other_outcomes_fail_closed(
    side_stack: Stack, rid: Rid, method: str, path: str, status: int
) -> None:
    stack, r = side_stack, rid("closed")
    resp = call(stack, r, method, path, follow_redirects=False)
    assert resp.status_code == status  # the harness gets the upstream's answer as is
    if status == 405:
        assert stack.reasons(r) == []
        return
    assert stack.reasons(r) == ["unrecognized_route"]
    info = stack.detail(r)
    assert info is not None and info["rollout"]["incomplete"]
    detail = info["incomplete_events"][0]["detail"]
    assert detail.startswith(f"{method} {path} -> status {status}")
    assert "token_id_capture_non_generating_requests" in detail


def test_a_declared_route_that_fails_is_not_harmless(side_stack: Stack, rid: Rid) -> None:
    stack, r = side_stack, rid("declfail")
    stack.engine.faults.next("http_500", route="/tokenize")
    resp = call(stack, r, "POST", "/tokenize", json={"model": "smol", "prompt": "x"})
    assert resp.status_code == 500
    assert stack.reasons(r) == ["unrecognized_route"]


@pytest.fixture
def impatient_side_stack(db_url: str) -> Iterator[Stack]:
    engine = SimEngine(ByteTokenizer(), model_name="smol", seed=2)
    yield from start_stack(db_url, engine=engine, upstream_timeout_s=0.3)


def test_no_response_fails_closed(impatient_side_stack: Stack, rid: Rid) -> None:
    """The upstream holds a declared route past the timeout: no response is not harmless."""
    stack, r = impatient_side_stack, rid("hang")
    stack.engine.faults.next("hang", route="/tokenize")
    resp = call(stack, r, "POST", "/tokenize", json={"model": "smol", "prompt": "x"})
    assert resp.status_code == 504
    assert stack.reasons(r) == ["unrecognized_route"]


def test_count_tokens_is_answered_by_the_proxy_and_records_nothing(
    side_stack: Stack, rid: Rid
) -> None:
    stack, r = side_stack, rid("count")
    body = {"model": "smol", "messages": [{"role": "user", "content": "count me"}]}
    resp = call(stack, r, "POST", "/v1/messages/count_tokens?beta=true", json=body)
    assert resp.status_code == 200
    assert set(resp.json()) == {"input_tokens"} and resp.json()["input_tokens"] > 0
    assert stack.engine.requests[-1].path == "/tokenize"  # counted with the engine's template
    assert stack.detail(r) is None


# --------------------------------------------------------------------------- declarations


BAD_DECLARATIONS = [
    ({"method": "GET", "path": "/v1/*"}, "/v1/*"),
    ({"method": "GET", "path": "/v1/models?limit=1"}, "/v1/models?limit=1"),
    ({"method": 7, "path": "/v1/models"}, "7"),
    ({"method": "GET", "path": "v1/models"}, "v1/models"),
    ({"method": "GET", "path": "/v1/{model}"}, "/v1/{model}"),
    ({"method": "G E T", "path": "/v1/models"}, "G E T"),
    ({"method": "GET"}, "path"),
]


@pytest.mark.parametrize(("entry", "named"), BAD_DECLARATIONS)
def test_invalid_declarations_are_refused_naming_the_entry(
    entry: dict[str, Any], named: str
) -> None:
    routes = [{"method": "GET", "path": "/v1/fine"}, entry]
    with pytest.raises(ConfigError) as caught:
        load_settings(token_id_capture_non_generating_requests=routes)
    message = str(caught.value)
    assert "token_id_capture_non_generating_requests.1" in message  # which entry
    assert named in message


def test_serve_refuses_a_config_with_an_invalid_declaration(tmp_path: Path) -> None:
    config = tmp_path / "ledger.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "token_id_capture_non_generating_requests": [
                    {"method": "GET", "path": "/v1/models"},
                    {"method": "POST", "path": "/v1/*"},
                ]
            }
        )
    )
    result = CliRunner().invoke(
        cli_app, ["serve", "--config", str(config), "--db", f"sqlite:///{tmp_path / 'x.db'}"]
    )
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())  # rich wraps long lines
    assert "token_id_capture_non_generating_requests.1.path" in output
    assert "/v1/*" in output
    assert not (tmp_path / "x.db").exists()  # refused before touching the database
