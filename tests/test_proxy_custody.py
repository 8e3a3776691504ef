"""Issue #6 point 5: custody and capture failures, on both backends.

- the intent is recorded before dispatch; when it cannot be (the database is locked by
  another connection past a short busy/lock timeout), the call fails with 503 and nothing
  goes upstream;
- the record is committed before the harness gets its answer (also checked inside every SDK
  loop of test_proxy_openai/test_proxy_anthropic, right after each answer and at the first
  streamed event);
- missing token ids, a malformed token payload or a failed ledger write mark the rollout
  incomplete with the reason, and the call still succeeds;
- upstream errors reach the harness in its own dialect; a context overflow is re-worded for
  Anthropic (`prompt is too long: N tokens > M maximum`) from both vLLM error styles;
- the upstream timeout is configurable.
"""

from __future__ import annotations

import asyncio
import re
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import anthropic
import asyncpg
import httpx
import openai
import pytest
from sqlalchemy.engine import make_url
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import ledger.engine
from api.app import create_app
from ledger.config import load_settings
from ledger.errors import Unavailable
from ledger.store import Ledger
from rollout_sim import ByteTokenizer, SimEngine, ThreadedServer
from rollout_sim.engine import SimRequest
from tests.proxy_support import Stack, start_stack
from tests.support.stacks import shared_stack_as_stack  # noqa: F401  (the fixture `stack`)

Rid = Callable[[str], str]
HI = [{"role": "user", "content": "hi"}]
LOCK_WAIT_MS = 150  # how long the proxy's ledger waits for a lock another connection holds


def oai(stack: Stack, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base(rollout_id) + "/v1", api_key="sk", max_retries=0)


def claude(stack: Stack, rollout_id: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base(rollout_id), api_key="sk", max_retries=0)


def chat(stack: Stack, rollout_id: str, **kw: Any) -> Any:
    return oai(stack, rollout_id).chat.completions.create(model="smol", messages=HI, **kw)  # type: ignore[arg-type]


def message(stack: Stack, rollout_id: str, **kw: Any) -> Any:
    return claude(stack, rollout_id).messages.create(
        model="smol",
        max_tokens=256,
        messages=HI,  # type: ignore[arg-type]
        **kw,
    )


# --------------------------------------------------------------------------- intent custody


class DbLock:
    """Another connection holding the write lock the proxy's ledger needs: the whole SQLite
    file (`BEGIN EXCLUSIVE`) or the rollout's row on Postgres (`SELECT … FOR UPDATE`)."""

    def __init__(self, db_url: str, rollout_id: str) -> None:
        self.url = make_url(db_url)
        self.rollout_id = rollout_id
        self._sqlite: sqlite3.Connection | None = None
        self._held = threading.Event()
        self._release = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def acquire(self) -> DbLock:
        if self.url.get_backend_name() == "sqlite":
            conn = sqlite3.connect(
                str(self.url.database), isolation_level=None, check_same_thread=False
            )
            conn.execute("BEGIN EXCLUSIVE")
            self._sqlite = conn
            return self
        self._thread = threading.Thread(target=asyncio.run, args=(self._hold_row(),))
        self._thread.start()
        assert self._held.wait(10), f"could not lock the rollout row: {self._error}"
        return self

    async def _hold_row(self) -> None:
        try:
            conn = await asyncpg.connect(
                self.url.set(drivername="postgresql").render_as_string(False)
            )
        except BaseException as exc:
            self._error = exc
            raise
        try:
            async with conn.transaction():
                await conn.execute(
                    "SELECT 1 FROM rollouts WHERE rollout_id = $1 FOR UPDATE", self.rollout_id
                )
                self._held.set()
                await asyncio.to_thread(self._release.wait, 30)
        finally:
            await conn.close()

    def release(self) -> None:
        if self._sqlite is not None:
            self._sqlite.execute("ROLLBACK")
            self._sqlite.close()
            self._sqlite = None
        if self._thread is not None:
            self._release.set()
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> DbLock:
        return self.acquire()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@pytest.fixture
def short_lock_stack(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    """A proxy whose ledger gives up on a held lock after LOCK_WAIT_MS (SQLite busy_timeout,
    Postgres lock_timeout), instead of the production minute."""
    monkeypatch.setattr(ledger.engine, "SQLITE_BUSY_TIMEOUT_MS", LOCK_WAIT_MS)
    monkeypatch.setattr(ledger.engine, "PG_LOCK_TIMEOUT_MS", LOCK_WAIT_MS)
    yield from start_stack(db_url)


def test_intent_not_recorded_means_503_and_nothing_upstream(
    short_lock_stack: Stack, rid: Rid
) -> None:
    stack, r = short_lock_stack, rid("custody")
    stack.engine.script("first")
    chat(stack, r)  # the rollout exists (its row is what Postgres locks)
    sent_before = len(stack.engine.requests)
    with DbLock(stack.db_url, r):
        with pytest.raises(openai.APIStatusError) as oai_err:
            chat(stack, r)
        assert oai_err.value.status_code == 503
        assert "could not record this call before dispatch" in oai_err.value.message
        assert oai_err.value.body["code"] == "capture_unavailable"  # type: ignore[index]
        with pytest.raises(anthropic.APIStatusError) as claude_err:
            message(stack, r)
        assert claude_err.value.status_code == 503
        assert claude_err.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        assert "not sent to the model" in claude_err.value.body["error"]["message"]  # type: ignore[index]
        assert len(stack.engine.requests) == sent_before  # nothing went upstream
    stack.engine.script("after")
    assert chat(stack, r).choices[0].message.content == "after"
    detail = stack.detail(r)
    assert detail is not None
    assert [c["status"] for c in detail["calls"]] == ["captured", "captured"]
    assert detail["incomplete_events"] == []


def test_ledger_lost_after_the_intent_still_answers_and_freeze_flags_it(
    short_lock_stack: Stack, rid: Rid
) -> None:
    """The database goes away while the model runs: the harness still gets its answer; the
    dangling intent makes the rollout incomplete at freeze (no silent hole)."""
    stack, r = short_lock_stack, rid("lost")
    stack.engine.script("first")
    chat(stack, r)
    lock = DbLock(stack.db_url, r)

    def lock_then_answer(req: SimRequest) -> str:
        lock.acquire()  # the intent is committed by now; the record will not be
        return "answered anyway"

    stack.engine.responder = lock_then_answer
    try:
        assert chat(stack, r).choices[0].message.content == "answered anyway"
    finally:
        lock.release()
        stack.engine.responder = None
    state = stack.ledger_call("freeze_state", r)
    assert state.incomplete
    assert "dangling_intent" in stack.reasons(r)


STREAMING_BODIES = {
    "/v1/chat/completions": {"model": "smol", "messages": HI, "stream": True},
    "/v1/completions": {"model": "smol", "prompt": "hi", "max_tokens": 32, "stream": True},
    "/v1/responses": {"model": "smol", "input": "hi", "stream": True},
    "/v1/messages": {"model": "smol", "max_tokens": 32, "messages": HI, "stream": True},
}


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_the_record_is_committed_before_the_first_byte(
    stack: Stack, rid: Rid, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """Ordering, not just eventual presence: each record's commit returned before the harness
    saw the status line of its answer."""
    committed: list[float] = []
    original = Ledger.put

    async def timed_put(self: Ledger, *args: Any, **kwargs: Any) -> Any:
        result = await original(self, *args, **kwargs)
        committed.append(time.monotonic())
        return result

    monkeypatch.setattr(Ledger, "put", timed_put)
    r = rid("order")
    for path, body in STREAMING_BODIES.items():
        stack.engine.script("In order.")
        with httpx.stream("POST", stack.base(r) + path, json={**body, "stream": stream}) as resp:
            first_byte = time.monotonic()  # the status line and headers have arrived
            resp.read()
        assert resp.status_code == 200, (path, resp.text)
        assert resp.headers["content-type"].startswith(
            "text/event-stream" if stream else "application/json"
        )
        assert len(committed) == list(STREAMING_BODIES).index(path) + 1
        assert committed[-1] < first_byte, path
    assert stack.captured(r) == 4 and stack.reasons(r) == []


# --------------------------------------------------------------------------- capture failures


def test_missing_token_ids_mark_incomplete_and_the_call_succeeds(stack: Stack, rid: Rid) -> None:
    r = rid("noids")
    stack.engine.faults.next("no_token_ids")
    stack.engine.script("No ids here.")
    assert chat(stack, r).choices[0].message.content == "No ids here."
    assert stack.reasons(r) == ["missing_token_ids"]
    assert stack.ledger_call("get_state", r).incomplete

    # With token_id:N log-probs but no inline ids the prompt comes from /tokenize.
    r2 = rid("tok")
    stack.engine.faults.next("no_token_ids", keep_logprobs=True)
    stack.engine.script("Ids from log-probs.")
    answer = message(stack, r2)
    assert answer.content[0].text == "Ids from log-probs."
    assert stack.engine.requests[-1].path == "/tokenize"
    assert stack.reasons(r2) == [] and stack.captured(r2) == 1


@pytest.mark.parametrize("variant", ["length", "mismatch", "usage"])
def test_malformed_token_payload_marks_incomplete_and_the_call_succeeds(
    stack: Stack, rid: Rid, variant: Any
) -> None:
    r = rid("bad")
    stack.engine.faults.next("malformed_tokens", variant=variant)
    stack.engine.script("Still answered.")
    with oai(stack, r).chat.completions.stream(model="smol", messages=HI) as events:  # type: ignore[arg-type]
        final = events.get_final_completion()
    assert final.choices[0].message.content == "Still answered."
    assert stack.reasons(r) == ["malformed_token_payload"]
    detail = stack.detail(r)
    assert detail is not None and detail["calls"][0]["status"] == "intent"


@pytest.mark.parametrize("error", ["ledger", "bug"])
def test_failed_record_write_marks_capture_failed_and_the_call_succeeds(
    stack: Stack, rid: Rid, monkeypatch: pytest.MonkeyPatch, error: str
) -> None:
    r = rid("wfail")

    async def failing_put(self: Ledger, *args: Any, **kwargs: Any) -> Any:
        if error == "ledger":
            raise Unavailable("ledger database unavailable: disk I/O error")
        raise RuntimeError("unexpected failure while recording")

    monkeypatch.setattr(Ledger, "put", failing_put)
    stack.engine.script("Answered.")
    assert chat(stack, r).choices[0].message.content == "Answered."
    stack.engine.script("Answered again.")
    with claude(stack, r).messages.stream(model="smol", max_tokens=64, messages=HI) as s:  # type: ignore[arg-type]
        assert s.get_final_message().content[0].text == "Answered again."  # type: ignore[union-attr]
    monkeypatch.undo()
    assert stack.reasons(r) == ["capture_failed", "capture_failed"]
    detail = stack.detail(r)
    assert detail is not None
    expected = "disk I/O error" if error == "ledger" else "unexpected failure while recording"
    assert all(expected in e["detail"] for e in detail["incomplete_events"])


# --------------------------------------------------------------------------- upstream errors


def test_upstream_5xx_reaches_each_harness_in_its_dialect(stack: Stack, rid: Rid) -> None:
    r = rid("e500")
    stack.engine.faults.next("http_500")
    with pytest.raises(openai.InternalServerError) as oai_err:
        chat(stack, r)
    assert "Simulated engine failure" in oai_err.value.message
    stack.engine.faults.next("http_500")
    with pytest.raises(anthropic.InternalServerError) as claude_err:
        message(stack, r)
    body = claude_err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "Simulated engine failure" in body["error"]["message"]  # type: ignore[index]

    # Codex / Responses streaming: a failed stream on HTTP 200, as Codex expects.
    stack.engine.faults.next("http_500")
    with httpx.stream(
        "POST",
        stack.base(r) + "/v1/responses",
        json={"model": "smol", "input": "hi", "stream": True},
    ) as resp:
        assert resp.status_code == 200
        text = "".join(resp.iter_text())
    assert "event: response.failed" in text and "Simulated engine failure" in text
    # No output reached a harness: each attempt stays open for a retry to settle (issue 11);
    # none came, so freeze counts them as lost calls.
    assert stack.reasons(r) == []
    stack.ledger_call("freeze_state", r)
    assert stack.reasons(r) == ["upstream_error"] * 3


def test_upstream_4xx_reaches_the_harness_and_closes_the_intent(stack: Stack, rid: Rid) -> None:
    r = rid("e404")
    with pytest.raises(openai.NotFoundError) as oai_err:
        oai(stack, r).chat.completions.create(model="gpt-unknown", messages=HI)  # type: ignore[arg-type]
    assert "does not exist" in oai_err.value.message
    with pytest.raises(anthropic.NotFoundError) as claude_err:
        claude(stack, r).messages.create(model="gpt-unknown", max_tokens=8, messages=HI)  # type: ignore[arg-type]
    assert claude_err.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    detail = stack.detail(r)
    assert detail is not None
    assert [c["status"] for c in detail["calls"]] == ["cancelled", "cancelled"]
    assert detail["incomplete_events"] == []  # nothing was generated, nothing is missing


@pytest.fixture(params=["new", "old"])
def small_context_stack(db_url: str, request: pytest.FixtureRequest) -> Iterator[Stack]:
    engine = SimEngine(ByteTokenizer(), max_model_len=256, seed=1, error_style=request.param)
    yield from start_stack(db_url, engine=engine)


def test_context_overflow_is_reworded_for_anthropic(small_context_stack: Stack, rid: Rid) -> None:
    stack, r = small_context_stack, rid("ctx")
    long = [{"role": "user", "content": "word " * 100}]  # 500 bytes: over 256 tokens
    with pytest.raises(anthropic.BadRequestError) as claude_err:
        claude(stack, r).messages.create(model="smol", max_tokens=16, messages=long)  # type: ignore[arg-type]
    error = claude_err.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", error["message"])
    assert match is not None, error["message"]
    assert int(match.group(2)) == 256 and int(match.group(1)) > 256

    with pytest.raises(openai.BadRequestError) as oai_err:
        oai(stack, r).chat.completions.create(model="smol", max_tokens=16, messages=long)  # type: ignore[arg-type]
    assert oai_err.value.code == "context_length_exceeded"
    assert "maximum context length is 256 tokens" in oai_err.value.message  # vLLM's own text
    assert stack.reasons(r) == []  # a refused prompt generated nothing


@pytest.fixture
def impatient_stack(db_url: str) -> Iterator[Stack]:
    yield from start_stack(db_url, upstream_timeout_s=0.5)


def test_upstream_timeout_is_configurable(impatient_stack: Stack, rid: Rid) -> None:
    stack, r = impatient_stack, rid("slow")
    stack.engine.faults.next("hang")
    with pytest.raises(openai.APIStatusError) as oai_err:
        chat(stack, r)
    assert oai_err.value.status_code == 504
    assert "did not answer in time" in oai_err.value.message
    stack.engine.faults.next("hang")
    with pytest.raises(anthropic.APIStatusError) as claude_err:
        message(stack, r)
    assert claude_err.value.status_code == 504
    assert claude_err.value.body["error"]["type"] == "timeout_error"  # type: ignore[index]
    stack.ledger_call("freeze_state", r)
    assert stack.reasons(r) == ["upstream_error"] * 2
    detail = stack.detail(r)
    assert detail is not None
    assert all(e["detail"].startswith("timeout:") for e in detail["incomplete_events"])


def test_unreachable_upstream_is_a_502_in_the_dialect(db_url: str, rid: Rid) -> None:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    settings = load_settings(db=db_url, upstream=dead)
    with ThreadedServer(create_app(settings), lifespan="on", startup_timeout=60) as proxy:
        base = f"{proxy.url}/ng-rollout/{rid('dead')}/training-token-capture"
        r = base.split("/")[-2]
        with pytest.raises(openai.APIStatusError) as oai_err:
            openai.OpenAI(
                base_url=base + "/v1", api_key="sk", max_retries=0
            ).chat.completions.create(
                model="smol",
                messages=HI,  # type: ignore[arg-type]
            )
        assert oai_err.value.status_code == 502
        assert "could not be reached" in oai_err.value.message
        with pytest.raises(anthropic.APIStatusError) as claude_err:
            anthropic.Anthropic(base_url=base, api_key="sk", max_retries=0).messages.create(
                model="smol",
                max_tokens=8,
                messages=HI,  # type: ignore[arg-type]
            )
        assert claude_err.value.status_code == 502
        assert claude_err.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        stack = Stack(SimEngine(ByteTokenizer()), dead, proxy.url, db_url, settings)
        stack.ledger_call("freeze_state", r)
        assert stack.reasons(r) == ["upstream_error"] * 2


@pytest.fixture
def garbage_stack(db_url: str) -> Iterator[tuple[Stack, list[Any]]]:
    """An upstream whose chat route answers 200 with bodies no harness can be given."""
    engine = SimEngine(ByteTokenizer(), seed=3)
    answers: list[Any] = []

    async def garbage(request: Request) -> Response:
        return JSONResponse(answers.pop(0))

    engine.app.router.routes.insert(0, Route("/v1/chat/completions", garbage, methods=["POST"]))
    for stack in start_stack(db_url, engine=engine):
        yield stack, answers


def test_an_unusable_upstream_answer_is_a_502_in_the_dialect(
    garbage_stack: tuple[Stack, list[Any]], rid: Rid
) -> None:
    (stack, answers), r = garbage_stack, rid("junk")
    answers += [{"id": "x", "choices": []}, [1, 2], {"id": "y", "choices": []}]
    with pytest.raises(anthropic.APIStatusError) as claude_err:
        message(stack, r)
    assert claude_err.value.status_code == 502
    assert claude_err.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "exactly one choice" in claude_err.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as oai_err:
        chat(stack, r)
    assert oai_err.value.status_code == 502 and "not a JSON object" in oai_err.value.message
    with httpx.stream(
        "POST",
        stack.base(r) + "/v1/responses",
        json={"model": "smol", "input": "hi", "stream": True},
    ) as resp:
        text = "".join(resp.iter_text())
    assert resp.status_code == 200 and "event: response.failed" in text
    assert stack.reasons(r) == ["malformed_token_payload"] * 3
