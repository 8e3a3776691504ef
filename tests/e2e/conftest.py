"""Fixtures of the end-to-end tier: one recorder in front of vLLM and one `rollout-ledger serve`
per ledger backend, shared by every test of the session (see ``harness``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from rollout_sim import ThreadedServer
from tests.e2e.harness import (
    MODEL,
    PG_URL,
    SUPPLY_PREFIX,
    VLLM_URL,
    Proxy,
    Recorder,
    db_url_for,
    start_serve,
    stop,
)

# Not marked `postgres`: that marker turns a skip into a failure under ROLLOUT_LEDGER_REQUIRE_PG,
# and this whole tier skips without vLLM.
BACKENDS = ["sqlite", *(["postgres"] if PG_URL else [])]


@pytest.fixture(scope="session")
def recorder() -> Iterator[Recorder]:
    try:
        version = httpx.get(VLLM_URL + "/version", timeout=10).json().get("version")
    except (httpx.HTTPError, ValueError) as exc:
        pytest.fail(f"ROLLOUT_LEDGER_VLLM_URL={VLLM_URL} does not answer: {exc}")
    print(f"\n[e2e] vLLM {version} at {VLLM_URL}, model {MODEL!r}, supply_prefix={SUPPLY_PREFIX}")
    rec = Recorder(VLLM_URL)
    with ThreadedServer(rec.app, lifespan="on", startup_timeout=30) as server:
        rec.url = server.url
        yield rec


@pytest.fixture(scope="session", params=BACKENDS)
def proxy(
    request: pytest.FixtureRequest, recorder: Recorder, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proxy]:
    backend = str(request.param)
    workdir = tmp_path_factory.mktemp(f"e2e-{backend}")
    started = time.perf_counter()
    proxy = start_serve(backend, db_url_for(backend, workdir), recorder, workdir)
    took = time.perf_counter() - started
    print(f"[e2e] rollout-ledger serve ({backend}) healthy in {took:.1f} s")
    try:
        yield proxy
    finally:
        stop(proxy.proc)
        print(f"[e2e] rollout-ledger serve ({backend}) stopped (pid {proxy.proc.pid})")
