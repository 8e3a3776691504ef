"""Fixtures for proxy tests: a simulated vLLM and the proxy, each on a real loopback port.

``Stack`` records every capture answer as the engine sent it (``stack.sampled``), which is what
the engine sampled: the tests compare delivered chains against it, token for token.  The proxy
reaches the engine over its own upstream clients (aiohttp for generating calls), as in serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from api.app import create_app
from ledger import migrate
from ledger.config import Settings, load_settings
from ledger.delivery import finalize_rollout_token_capture
from ledger.errors import NotFound
from ledger.store import Audit, Ledger
from rollout_sim import ByteTokenizer, SimEngine, ThreadedServer
from tests.conftest import BACKENDS, require_postgres
from tests.helpers.fault_support import UpstreamTap


@dataclass
class Stack:
    engine: SimEngine
    upstream_url: str
    url: str
    db_url: str
    settings: Settings
    tap: UpstreamTap | None = None

    @property
    def sampled(self) -> list[dict[str, Any]]:
        """The engine's answers to the proxy's capture requests, in order."""
        return [] if self.tap is None else self.tap.capture_answers()

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

    def detail(self, rollout_id: str) -> dict[str, Any] | None:
        """The audit view of one rollout (calls, edges, incomplete events), None if unknown."""

        async def run() -> dict[str, Any] | None:
            led = Ledger(self.db_url)
            try:
                return await Audit(led).rollout_detail(rollout_id)
            except NotFound:
                return None
            finally:
                await led.close()

        return asyncio.run(run())

    def captured(self, rollout_id: str) -> int:
        """How many calls of the rollout are committed with their tokens."""
        info = self.detail(rollout_id)
        return 0 if info is None else sum(c["status"] == "captured" for c in info["calls"])

    def reasons(self, rollout_id: str) -> list[str]:
        """The incomplete-event reasons stored for the rollout, in order."""
        info = self.detail(rollout_id)
        return [] if info is None else [e["reason"] for e in info["incomplete_events"]]


def start_stack(
    db_url: str,
    engine: SimEngine | None = None,
    upstream_transport: httpx.AsyncBaseTransport | None = None,
    **settings_kw: Any,
) -> Iterator[Stack]:
    """The engine behind an :class:`UpstreamTap` and the proxy in front of it, each on its own
    loopback port.  ``upstream_transport``: an httpx transport for the proxy's upstream calls
    (a fault double; the generating POST then goes over httpx instead of aiohttp)."""
    engine = engine or SimEngine(ByteTokenizer(), model_name="smol", max_model_len=16384, seed=7)
    tap = UpstreamTap(engine.app)
    with ThreadedServer(tap) as upstream:
        settings = load_settings(db=db_url, upstream=upstream.url + "/v1", **settings_kw)
        app = create_app(settings, upstream_transport=upstream_transport)
        with ThreadedServer(app, lifespan="on", startup_timeout=60) as proxy:
            yield Stack(engine, upstream.url, proxy.url, db_url, settings, tap)


@pytest.fixture
def stack(db_url: str) -> Iterator[Stack]:
    yield from start_stack(db_url)


# Shared stacks: one per backend for the whole session (starting two uvicorn servers per test
# dominates a proxy test's cost).  Tests sharing one use unique rollout ids (`rid`), and the
# function-scoped fixtures below reset the engine and `sampled` before each test.


@pytest.fixture(scope="session", params=BACKENDS)
def session_db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated database shared by the session: one SQLite file, or the run's Postgres."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('shared') / 'ledger.db'}"
    else:
        url = require_postgres()
    migrate.upgrade(url)
    return url


def reset(stack: Stack) -> Stack:
    """Forget what earlier tests left in a shared stack's engine and recordings."""
    engine = stack.engine
    engine.requests.clear()
    engine.faults.clear()
    engine._scripts.clear()
    engine.responder = None
    if stack.tap is not None:
        stack.tap.forget()
    return stack


@pytest.fixture(scope="session")
def _session_stack(session_db_url: str) -> Iterator[Stack]:
    yield from start_stack(session_db_url)


@pytest.fixture
def shared_stack(_session_stack: Stack) -> Stack:
    """Like `stack`, but the proxy and engine are shared across the session (per backend)."""
    return reset(_session_stack)


@pytest.fixture(scope="session")
def _session_thinking_stack(session_db_url: str) -> Iterator[Stack]:
    engine = SimEngine(
        ByteTokenizer(), model_name="smol", max_model_len=16384, seed=5, reasoning_parser=True
    )
    yield from start_stack(session_db_url, engine=engine)


@pytest.fixture
def shared_thinking_stack(_session_thinking_stack: Stack) -> Stack:
    """A shared stack whose engine runs a reasoning parser (`<think>…</think>`)."""
    return reset(_session_thinking_stack)


def sampled_chain(stack: Stack, indices: list[int]) -> tuple[list[int], list[int], list[float]]:
    """The full last prompt, all generated ids and all log-probs of the given upstream answers."""
    gen: list[int] = []
    lps: list[float] = []
    for i in indices:
        answer = stack.sampled[i]
        choice = answer["choices"][0]
        gen += choice["token_ids"]
        logprobs = choice["logprobs"]
        if "content" in logprobs:  # chat
            lps += [c["logprob"] for c in logprobs["content"]]
        else:  # completions: the legacy shape
            lps += logprobs["token_logprobs"]
    last = stack.sampled[indices[-1]]
    prompt = last.get("prompt_token_ids") or last["choices"][0]["prompt_token_ids"]
    return prompt, gen, lps


def delivered(result: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    carriers = [i for i in result["response"]["output"] if "generation_token_ids" in i]
    gen = [t for c in carriers for t in c["generation_token_ids"]]
    lps = [lp for c in carriers for lp in c["generation_log_probs"]]
    return carriers[-1]["prompt_token_ids"], gen, lps
