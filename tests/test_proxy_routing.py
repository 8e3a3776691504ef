"""Issue #6 points 1-2: `rollout-ledger serve`, and how the proxy routes a request.

- `serve` runs the proxy and the ledger API in one process, migrates the database (a SQLite
  file in the working directory by default), takes the upstream with or without `/v1`, and
  without an upstream answers proxy routes 503 saying so;
- `/ng-rollout/<id>/training-token-capture/...` is captured, `/ng-rollout/<id>/...` is only
  forwarded (evaluation correlation), anything else is plain pass-through; a malformed id is
  a 400 that says what is allowed; query strings (`?beta=true`) are tolerated.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from ledger import migrate
from ledger.config import load_settings
from rollout_sim import ByteTokenizer, SimEngine, ThreadedServer
from tests.proxy_support import Stack
from tests.support.net import free_port as _free_port
from tests.support.stacks import shared_stack_as_stack  # noqa: F401  (the fixture `stack`)

Rid = Callable[[str], str]
CHAT_BODY: dict[str, Any] = {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}
CAPTURE_FIELDS = ("logprobs", "return_token_ids", "return_tokens_as_token_ids")
CLI = Path(sys.executable).with_name("rollout-ledger")


# --------------------------------------------------------------------------- serve


@contextlib.contextmanager
def serve(cwd: Path, *args: str, deadline_s: float = 60.0) -> Iterator[str]:
    """`rollout-ledger serve ARGS` as its own process; yields its base URL once /healthz is up."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LEDGER_")}
    log = (cwd / f"serve-{port}.log").open("wb")
    proc = subprocess.Popen(
        [str(CLI), "serve", "--port", str(port), "--log-level", "warning", *args],
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + deadline_s
        while True:
            assert proc.poll() is None, (cwd / f"serve-{port}.log").read_text()
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "serve did not become healthy in time"
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.05)  # a bounded wait on the process, not a blind sleep
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def test_serve_defaults_to_a_migrated_sqlite_file_and_503s_without_upstream(
    tmp_path: Path, rid: Rid
) -> None:
    with serve(tmp_path) as url:
        health = httpx.get(url + "/healthz").json()
        assert health["status"] == "ok" and health["schema"] == migrate.head_revision()
        assert health["upstream"] is None
        assert (tmp_path / "rollout-ledger.db").is_file()  # the default: a file right here

        r = rid("nou")
        for path in (
            f"/ng-rollout/{r}/training-token-capture/v1/chat/completions",
            f"/ng-rollout/{r}/v1/chat/completions",
            "/v1/chat/completions",
        ):
            resp = httpx.post(url + path, json=CHAT_BODY)
            assert resp.status_code == 503, path
            assert "no upstream is configured" in resp.json()["error"]["message"]
        assert httpx.get(url + "/v1/models").status_code == 503

        # The ledger API answers from the same process, on the same file.
        assert httpx.get(url + "/ledger/v1/stats").status_code == 200
        assert httpx.get(url + f"/ledger/v1/rollouts/{r}").status_code == 404  # nothing recorded


@pytest.mark.parametrize("suffix", ["", "/v1", "/v1/"])
def test_upstream_url_with_or_without_v1(suffix: str) -> None:
    settings = load_settings(upstream="http://127.0.0.1:8000" + suffix)
    assert settings.upstream == "http://127.0.0.1:8000"


def test_serve_captures_through_a_bare_upstream_url(
    tmp_path: Path, db_url: str, rid: Rid, backend: str
) -> None:
    """One process, both backends: upstream given without `/v1` on SQLite and with it on
    Postgres (both forms reach the same paths)."""
    engine = SimEngine(ByteTokenizer(), model_name="smol", seed=3)
    with ThreadedServer(engine.app) as upstream:
        up = upstream.url + ("" if backend == "sqlite" else "/v1")
        with serve(tmp_path, "--db", db_url, "--upstream", up) as url:
            r = rid("serve")
            engine.script("Served.")
            resp = httpx.post(
                url + f"/ng-rollout/{r}/training-token-capture/v1/chat/completions",
                json=CHAT_BODY,
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == "Served."
            assert engine.requests[-1].path == "/v1/chat/completions"
            detail = httpx.get(url + f"/ledger/v1/rollouts/{r}").json()
            assert [c["status"] for c in detail["calls"]] == ["captured"]


# --------------------------------------------------------------------------- routing


def test_training_capture_route_records_the_call(stack: Stack, rid: Rid) -> None:
    r = rid("cap")
    stack.engine.script("Recorded.")
    resp = httpx.post(stack.base(r) + "/v1/chat/completions", json=CHAT_BODY)
    assert resp.status_code == 200, resp.text
    sent = stack.engine.requests[-1].body
    assert all(sent[f] for f in CAPTURE_FIELDS)  # the proxy asked for ids
    assert "token_ids" not in resp.json()["choices"][0]
    assert stack.captured(r) == 1


def test_evaluation_route_forwards_and_records_nothing(stack: Stack, rid: Rid) -> None:
    r = rid("eval")
    body = {**CHAT_BODY, "max_tokens": 50}
    stack.engine.script("Evaluated.")
    resp = httpx.post(stack.base(r, training=False) + "/v1/chat/completions?x=1", json=body)
    assert resp.status_code == 200, resp.text
    seen = stack.engine.requests[-1]
    assert (seen.path, seen.query, seen.body) == ("/v1/chat/completions", "x=1", body)
    assert resp.json()["choices"][0]["message"]["content"] == "Evaluated."
    assert stack.detail(r) is None  # no rollout row, no intent, nothing

    models = httpx.get(stack.base(r, training=False) + "/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "smol"
    assert stack.detail(r) is None


def test_plain_paths_pass_through_untouched(stack: Stack) -> None:
    body = {**CHAT_BODY, "stream": True}
    stack.engine.script("Passed.")
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = "".join(resp.iter_text())
    assert stack.engine.requests[-1].body == body  # no capture fields added
    assert text.rstrip().endswith("data: [DONE]")
    assert httpx.get(stack.url + "/version").json() == {"version": "0.32.0"}
    assert httpx.get(stack.url + "/nowhere").status_code == 404  # the upstream's own 404


async def _maybe_gzip(request: Request) -> Response:
    """Answers gzip when offered (as many servers do), naming what it was offered."""
    offered = request.headers.get("accept-encoding", "")
    body = json.dumps({"offered": offered}).encode()
    if "gzip" in offered:
        return Response(gzip.compress(body), headers={"content-encoding": "gzip"})
    return Response(body)


def test_pass_through_keeps_the_content_encoding(stack: Stack, rid: Rid) -> None:
    """Raw (still encoded) bytes go back with their content-encoding; a harness that offers
    no encoding is not sent one it never asked for."""
    if not any(getattr(r, "path", None) == "/v1/gz" for r in stack.engine.app.routes):
        stack.engine.app.add_route("/v1/gz", _maybe_gzip, methods=["GET"])
    for base in (stack.url, stack.base(rid("gz"), training=False)):
        offered = httpx.get(base + "/v1/gz", headers={"accept-encoding": "gzip"})
        assert offered.headers["content-encoding"] == "gzip"
        assert offered.json() == {"offered": "gzip"}  # httpx decoded it
        with httpx.Client() as client:
            client.headers.pop("accept-encoding")
            plain = client.get(base + "/v1/gz")
        assert "content-encoding" not in plain.headers
        assert plain.json() == {"offered": "identity"}


BAD_IDS = ("-leading-dash", "has space", "semi;colon", "x" * 201, "ünïcode", "a:b")


def test_malformed_rollout_id_is_a_400_that_says_what_is_allowed(stack: Stack) -> None:
    n_before = len(stack.engine.requests)
    for bad_id in BAD_IDS:
        for seg in ("/training-token-capture", ""):
            url = f"{stack.url}/ng-rollout/{bad_id}{seg}/v1/chat/completions"
            resp = httpx.post(url, json=CHAT_BODY)
            assert resp.status_code == 400, (bad_id, resp.text)
            message = resp.json()["error"]["message"]
            assert "letters, digits, dots, dashes or underscores" in message
            assert "at most 200 characters" in message
    assert len(stack.engine.requests) == n_before  # nothing went upstream


def test_empty_rollout_id_is_refused(stack: Stack) -> None:
    resp = httpx.post(
        f"{stack.url}/ng-rollout//training-token-capture/v1/chat/completions", json=CHAT_BODY
    )
    assert resp.status_code == 400
    assert "starting with a letter or digit" in resp.json()["error"]["message"]


def test_query_strings_are_tolerated_on_capture_routes(stack: Stack, rid: Rid) -> None:
    """Claude Code's `?beta=true` on messages and count_tokens."""
    r = rid("beta")
    stack.engine.script("With a query.")
    body = {"model": "smol", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    resp = httpx.post(stack.base(r) + "/v1/messages?beta=true", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["content"] == [{"type": "text", "text": "With a query."}]
    count = httpx.post(stack.base(r) + "/v1/messages/count_tokens?beta=true", json=body)
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
    chat = httpx.post(stack.base(r) + "/v1/chat/completions?api-version=1", json=CHAT_BODY)
    assert chat.status_code == 200
    assert stack.captured(r) == 2 and stack.reasons(r) == []


def test_capture_refuses_a_body_that_is_not_json(stack: Stack, rid: Rid) -> None:
    r = rid("junk")
    n_before = len(stack.engine.requests)
    resp = httpx.post(
        stack.base(r) + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400
    assert "not valid JSON" in resp.json()["error"]["message"]
    resp = httpx.post(stack.base(r) + "/v1/messages", content=json.dumps([1, 2]))
    assert resp.status_code == 400 and resp.json()["type"] == "error"
    assert len(stack.engine.requests) == n_before


ODD_BODIES = [
    ("/v1/chat/completions", {"model": "smol", "messages": "hi"}, "`messages` must be a list"),
    ("/v1/completions", {"model": "smol"}, "`prompt` is required"),
    (
        "/v1/messages",
        {"model": "smol", "max_tokens": 8, "messages": [{"role": {}, "content": "x"}]},
        "messages[0].role",
    ),
    (
        "/v1/responses",
        {"model": "smol", "input": [{"role": "user", "content": [{"type": ["x"]}]}]},
        "input[0]",
    ),
    ("/v1/responses", {"model": "smol", "input": "x", "previous_response_id": "r"}, "keeps no"),
]


def test_odd_request_shapes_get_a_400_in_the_dialect(stack: Stack, rid: Rid) -> None:
    """Bad input changes nothing: no intent, nothing upstream, a 400 that says what is wrong."""
    r = rid("odd")
    for path, body, says in ODD_BODIES:
        resp = httpx.post(stack.base(r) + path, json=body)
        assert resp.status_code == 400, (path, resp.text)
        error = resp.json()["error"]
        assert says in error["message"], (path, error)
        if path == "/v1/messages":
            assert resp.json()["type"] == "error"
            assert error["type"] == "invalid_request_error"
    assert stack.engine.requests == [] and stack.detail(r) is None


def test_percent_encoded_paths_are_forwarded_not_crashed_on(stack: Stack, rid: Rid) -> None:
    """A %00 or a space in the path reaches the upstream encoded (here: its 404)."""
    r = rid("pct")
    for url in (
        stack.url + "/v1/a%00b",
        stack.url + "/v1/with%20space",
        stack.base(r, training=False) + "/v1/a%00b",
        stack.base(r) + "/v1/a%00b",
    ):
        assert httpx.get(url).status_code == 404, url
    assert [q.path for q in stack.engine.requests if q.path.startswith("/v1/")] == []
    assert stack.reasons(r) == []  # a 404 on a capture route is harmless
