"""Fixtures for proxy tests: a simulated vLLM and the proxy, each on a real loopback port.

``Stack`` records every upstream answer as it crossed the wire (``stack.sampled``), which is
what the engine sampled: the tests compare delivered chains against it, token for token.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from api.app import create_app
from ledger.config import Settings, load_settings
from ledger.delivery import finalize_rollout_token_capture
from ledger.sim import ByteTokenizer, SimEngine, ThreadedServer
from ledger.store import Ledger


class RecordingTransport(httpx.AsyncHTTPTransport):
    """The proxy's upstream transport, keeping each generating answer's JSON."""

    def __init__(self, sink: list[dict[str, Any]]) -> None:
        super().__init__()
        self.sink = sink

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path in ("/v1/chat/completions", "/v1/completions"):
            body = await response.aread()
            if response.status_code == 200:
                self.sink.append(json.loads(body))
            return httpx.Response(
                response.status_code, headers=response.headers, content=body, request=request
            )
        return response


@dataclass
class Stack:
    engine: SimEngine
    upstream_url: str
    url: str
    db_url: str
    settings: Settings
    sampled: list[dict[str, Any]] = field(default_factory=list)

    def base(self, rollout_id: str, training: bool = True) -> str:
        seg = "/training-token-capture" if training else ""
        return f"{self.url}/ng-rollout/{rollout_id}{seg}"

    def finalize(self, result: dict[str, Any], **kw: Any) -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            led = Ledger(self.db_url)
            try:
                build = await finalize_rollout_token_capture(result, led, **kw)
                assert build is not None
                return build
            finally:
                await led.close()

        return asyncio.run(run())

    def ledger_call(self, fn: str, *args: Any, **kw: Any) -> Any:
        async def run() -> Any:
            led = Ledger(self.db_url)
            try:
                return await getattr(led, fn)(*args, **kw)
            finally:
                await led.close()

        return asyncio.run(run())


def start_stack(
    db_url: str, engine: SimEngine | None = None, **settings_kw: Any
) -> Iterator[Stack]:
    engine = engine or SimEngine(ByteTokenizer(), model_name="smol", max_model_len=16384, seed=7)
    with ThreadedServer(engine.app) as upstream:
        settings = load_settings(db=db_url, upstream=upstream.url + "/v1", **settings_kw)
        sampled: list[dict[str, Any]] = []
        app = create_app(settings, upstream_transport=RecordingTransport(sampled))
        with ThreadedServer(app, lifespan="on", startup_timeout=60) as proxy:
            yield Stack(engine, upstream.url, proxy.url, db_url, settings, sampled)


@pytest.fixture
def stack(db_url: str) -> Iterator[Stack]:
    yield from start_stack(db_url)


def sampled_chain(stack: Stack, indices: list[int]) -> tuple[list[int], list[int], list[float]]:
    """The full last prompt, all generated ids and all log-probs of the given upstream answers."""
    gen: list[int] = []
    lps: list[float] = []
    for i in indices:
        answer = stack.sampled[i]
        choice = answer["choices"][0]
        gen += choice["token_ids"]
        lps += [c["logprob"] for c in choice["logprobs"]["content"]]
    last = stack.sampled[indices[-1]]
    prompt = last.get("prompt_token_ids") or last["choices"][0]["prompt_token_ids"]
    return prompt, gen, lps


def delivered(result: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    carriers = [i for i in result["response"]["output"] if "generation_token_ids" in i]
    gen = [t for c in carriers for t in c["generation_token_ids"]]
    lps = [lp for c in carriers for lp in c["generation_log_probs"]]
    return carriers[-1]["prompt_token_ids"], gen, lps
