"""Issue 11 point 3: a retried upstream failure must not mask the rollout.

An upstream attempt that put nothing in front of the harness (a 5xx, a refused connection:
the proxy never streams a partial answer) stays open; when a retry of the same request
succeeds it is recorded as cancelled, so the rollout is delivered.  A refused connection is
retried once by the proxy itself.  Without a successful retry the attempt is a lost call at
freeze (``upstream_error``), and a call whose output reached the harness without a record
still masks.  Driven by the real OpenAI and Anthropic SDKs (their own retries) against the
simulated vLLM.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from api.app import create_app
from ledger.config import load_settings
from rollout_sim import ByteTokenizer, SimEngine, ThreadedServer
from tests.proxy_support import Stack, delivered, sampled_chain, start_stack
from tests.support.net import read_request, reset

Rid = Callable[[str], str]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def stack(shared_stack: Stack) -> Stack:
    return shared_stack


def statuses(stack: Stack, rollout_id: str) -> list[str]:
    detail = stack.detail(rollout_id)
    assert detail is not None
    return [c["status"] for c in detail["calls"]]


def finalize(stack: Stack, rollout_id: str, response_id: str) -> tuple[dict[str, Any], Any]:
    result: dict[str, Any] = {"_ng_rollout_id": rollout_id, "response": {"id": response_id}}
    result["response"]["output"] = []
    return result, stack.finalize(result)


def test_openai_sdk_retry_after_a_5xx_is_delivered(stack: Stack, rid: Rid) -> None:
    r = rid("retry5xx")
    client = openai.OpenAI(base_url=stack.base(r) + "/v1", api_key="sk", max_retries=2)
    stack.engine.faults.next("http_500")
    answer = client.chat.completions.create(model="smol", messages=HI)  # type: ignore[arg-type]
    assert statuses(stack, r) == ["cancelled", "captured"]
    result, build = finalize(stack, r, answer.id)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert not result["_ng_token_capture"]["capture_incomplete"]
    assert delivered(result) == sampled_chain(stack, [0])


def test_anthropic_sdk_retry_after_a_5xx_is_delivered(stack: Stack, rid: Rid) -> None:
    r = rid("retryclaude")
    client = anthropic.Anthropic(base_url=stack.base(r), api_key="sk", max_retries=2)
    stack.engine.faults.next("http_500")
    message = client.messages.create(model="smol", max_tokens=64, messages=HI)  # type: ignore[arg-type]
    assert statuses(stack, r) == ["cancelled", "captured"]
    _, build = finalize(stack, r, message.id)
    assert build["outcome"] == "delivered", build["mask_reasons"]


def test_a_failure_without_a_successful_retry_is_a_lost_call(stack: Stack, rid: Rid) -> None:
    r = rid("noretry")
    client = openai.OpenAI(base_url=stack.base(r) + "/v1", api_key="sk", max_retries=0)
    stack.engine.script("First.")
    first = client.chat.completions.create(model="smol", messages=HI)  # type: ignore[arg-type]
    stack.engine.faults.next("http_500")
    follow = [*HI, {"role": "assistant", "content": "First."}, {"role": "user", "content": "more"}]
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="smol", messages=follow)  # type: ignore[arg-type]
    # A different request succeeding is not a retry of the failed one.
    client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x"}])  # type: ignore[arg-type]
    assert statuses(stack, r) == ["captured", "intent", "captured"]
    _, build = finalize(stack, r, first.id)
    assert build["outcome"] == "masked"
    assert "capture_incomplete" in build["mask_reasons"]
    assert stack.reasons(r) == ["upstream_error"]


def test_output_that_reached_the_harness_without_a_record_still_masks(
    stack: Stack, rid: Rid
) -> None:
    """The seed's rule: an intent with no record at freeze (the answer was served, the record
    never written) masks, whatever retries follow."""
    r = rid("served")
    client = openai.OpenAI(base_url=stack.base(r) + "/v1", api_key="sk", max_retries=0)
    answer = client.chat.completions.create(model="smol", messages=HI)  # type: ignore[arg-type]
    # A harness that got its answer while the proxy lost the record: an open intent without
    # a failure note, exactly what a crash between answer and record leaves.
    stack.ledger_call("begin_call", r, "c-served", route="POST /v1/chat/completions")
    client.chat.completions.create(model="smol", messages=HI)  # type: ignore[arg-type]
    _, build = finalize(stack, r, answer.id)
    assert build["outcome"] == "masked"
    assert stack.reasons(r) == ["dangling_intent"]


class RefuseFirstConnects(httpx.AsyncHTTPTransport):
    """A fault injector in front of the real upstream: the first ``n`` generating requests
    find the port closed (``httpx.ConnectError``, what a refused connection raises).  A real
    port cannot refuse some connections and accept others, so this runs the generating POST
    over httpx (an injected transport selects it); ``tests/test_upstream.py`` refuses aiohttp's
    connections with a real closed port."""

    def __init__(self, inner: httpx.AsyncBaseTransport, n: int) -> None:
        super().__init__()
        self.inner, self.left, self.refused = inner, n, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions" and self.left > 0:
            self.left -= 1
            self.refused += 1
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return await self.inner.handle_async_request(request)


@pytest.fixture
def refusing(db_url: str) -> Iterator[tuple[Stack, RefuseFirstConnects]]:
    transport = RefuseFirstConnects(httpx.AsyncHTTPTransport(), 0)
    engine = SimEngine(ByteTokenizer(), max_model_len=16384, seed=3)
    for stack in start_stack(db_url, engine, upstream_transport=transport):
        yield stack, transport


def test_a_refused_connection_is_retried_once_by_the_proxy(
    refusing: tuple[Stack, RefuseFirstConnects], rid: Rid
) -> None:
    stack, transport = refusing
    r = rid("refused1")
    transport.left = 1
    client = openai.OpenAI(base_url=stack.base(r) + "/v1", api_key="sk", max_retries=0)
    answer = client.chat.completions.create(model="smol", messages=HI)  # type: ignore[arg-type]
    assert transport.refused == 1
    assert statuses(stack, r) == ["captured"]
    _, build = finalize(stack, r, answer.id)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    metrics = httpx.get(stack.url + "/metrics").text
    assert "rollout_ledger_upstream_retries_total 1.0" in metrics


def test_refused_twice_then_the_sdk_retry_succeeds(
    refusing: tuple[Stack, RefuseFirstConnects], rid: Rid
) -> None:
    stack, transport = refusing
    r = rid("refused2")
    transport.left = 2  # the proxy's own retry is refused as well
    client = anthropic.Anthropic(base_url=stack.base(r), api_key="sk", max_retries=2)
    message = client.messages.create(model="smol", max_tokens=64, messages=HI)  # type: ignore[arg-type]
    assert transport.refused == 2
    assert statuses(stack, r) == ["cancelled", "captured"]
    _, build = finalize(stack, r, message.id)
    assert build["outcome"] == "delivered", build["mask_reasons"]


class DropReusedConnections:
    """A TCP front for the real upstream that plays the keep-alive race: the first request on
    each connection is forwarded and answered (the connection stays open); the next request on
    that connection is read and the connection reset, as when the engine's server closes an
    idle connection just as the proxy sends on it.  Runs its own event loop in a thread."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.forwarded: list[str] = []
        self.dropped = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.url = ""

    def __enter__(self) -> DropReusedConnections:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line, _headers, body = await read_request(reader)
        method, path, _ = line.decode("latin-1").split(" ")
        async with httpx.AsyncClient(base_url=self.upstream) as client:
            resp = await client.request(
                method, path, content=body, headers={"content-type": "application/json"}
            )
        self.forwarded.append(f"{method} {path}")
        writer.write(
            f"HTTP/1.1 {resp.status_code} OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(resp.content)}\r\n\r\n".encode()
            + resp.content
        )
        await writer.drain()
        try:  # the next request on this kept-alive connection
            await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:  # the client closed it instead
            writer.close()
            return
        self.dropped += 1
        reset(writer)  # a reset instead of an answer


def test_a_reused_upstream_connection_dropped_before_answering_is_sent_again(
    db_url: str, rid: Rid
) -> None:
    """Serving as ``serve`` does (the generating POST over aiohttp): the proxy's second call
    goes out on the pooled connection, which the upstream resets; the proxy sends it again on a
    new connection, so the harness (no retries of its own) gets its answer, both calls are
    captured and the rollout is delivered."""
    engine = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=16384, seed=5)
    with ThreadedServer(engine.app) as upstream, DropReusedConnections(upstream.url) as front:
        settings = load_settings(db=db_url, upstream=front.url + "/v1")
        with ThreadedServer(create_app(settings), lifespan="on", startup_timeout=60) as proxy:
            r = rid("dropreused")
            base = f"{proxy.url}/ng-rollout/{r}/training-token-capture/v1"
            client = openai.OpenAI(base_url=base, api_key="sk", max_retries=0)
            messages: list[Any] = list(HI)
            answer = None
            for _ in range(2):
                answer = client.chat.completions.create(model="smol", messages=messages)
                messages += [
                    {"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": "more"},
                ]
            metrics = httpx.get(proxy.url + "/metrics").text
            stack = Stack(engine, upstream.url, proxy.url, db_url, settings)
            chat = [f for f in front.forwarded if f.endswith("/chat/completions")]
            assert (len(chat), front.dropped) == (2, 1)  # the dropped one never reached it
            assert statuses(stack, r) == ["captured", "captured"]
            assert answer is not None
            _, build = finalize(stack, r, answer.id)
    assert build["outcome"] == "delivered", build["mask_reasons"]
    assert "rollout_ledger_upstream_retries_total 1.0" in metrics
