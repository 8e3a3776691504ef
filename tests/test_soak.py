"""Issue #5 point 6: a bounded soak through a real ``rollout-ledger serve`` process.

64 concurrent harness sessions (asyncio tasks; chat, Anthropic and Responses dialects mixed),
each a multi-turn conversation of a few calls, in several waves against the simulated vLLM,
with the proxy's own RSS sampled after each wave.  Then:

- no harness call failed;
- no call was lost: every acknowledged call is in the ledger byte-for-byte (sampled prompt,
  generated ids and log-probs; the text the harness saw), nothing is half-written;
- every rollout rebuilds ``delivered``, its chain equal to what the upstream sampled;
- memory stays flat: RSS after the last wave is within ``RSS_GROWTH_LIMIT`` of RSS after the
  warm-up wave.

Bounded: at most ``WAVES * 64 * TURNS`` (1536 by default) calls per backend; waves stop once
``TIME_BUDGET_S`` is spent (after at least ``MIN_WAVES``), and everything that ran is checked.
Runs on SQLite and Postgres.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger.delivery import finalize_rollout_token_capture
from ledger.store import Ledger
from rollout_sim import ByteTokenizer, SimEngine, ThreadedServer
from tests.helpers.fault_harness import Session, check_acks_byte_for_byte, expected_chain
from tests.helpers.fault_support import ServeProcess, UpstreamTap, half_written, run_async
from tests.proxy_support import delivered

pytestmark = pytest.mark.slow  # deselect on a laptop with -m 'not slow'; CI runs it

Rid = Callable[[str], str]
CONCURRENCY = 64
TURNS = 3  # calls per session
WAVES = int(os.environ.get("ROLLOUT_LEDGER_SOAK_WAVES", "8"))  # the first one is the warm-up
MIN_WAVES = 3  # run even when the time budget is spent (one warm-up, two measured)
# Per backend, for the waves (startup and checks come on top); raise it for a longer local soak.
TIME_BUDGET_S = float(os.environ.get("ROLLOUT_LEDGER_SOAK_BUDGET_S", "20"))
CALL_TIMEOUT_S = 60.0
RSS_GROWTH_LIMIT = 0.15
DIALECTS = ("chat", "chat", "anthropic", "responses")


async def run_session(client: httpx.AsyncClient, base: str, s: Session) -> None:
    for _ in range(TURNS):
        try:
            resp = await client.post(
                f"{base}/ng-rollout/{s.rollout_id}/training-token-capture{s.path}", json=s.body()
            )
        except httpx.HTTPError as exc:
            s.failures.append(f"{type(exc).__name__}: {exc}")
            return
        if resp.status_code != 200:
            s.failures.append(f"HTTP {resp.status_code}: {resp.text[:300]}")
            return
        s.accept(resp.json())


async def run_wave(base: str, sessions: list[Session]) -> float:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(*(run_session(client, base, s) for s in sessions))
    return time.monotonic() - started


async def finalize_all(
    db_url: str, sessions: list[Session]
) -> list[tuple[Session, dict[str, Any], dict[str, Any]]]:
    led = Ledger(db_url)
    gate = asyncio.Semaphore(16)

    async def one(s: Session) -> tuple[Session, dict[str, Any], dict[str, Any]]:
        result: dict[str, Any] = {
            "_ng_rollout_id": s.rollout_id,
            "response": {"id": s.acks[-1].response_id, "output": []},
        }
        async with gate:
            build = await finalize_rollout_token_capture(result, led)
        assert build is not None
        return s, result, build

    try:
        return await asyncio.gather(*(one(s) for s in sessions))
    finally:
        await led.close()


def test_soak_64_sessions_no_loss_flat_memory(
    backend: str, db_url: str, rid: Rid, tmp_path: Path
) -> None:
    engine = SimEngine(ByteTokenizer(), model_name="smol", max_model_len=16384, seed=17)
    tap = UpstreamTap(engine.app)
    sessions: list[Session] = []
    rss: list[int] = []
    wave_s: list[float] = []
    with ThreadedServer(tap) as upstream:
        serve = ServeProcess(db_url, upstream.url + "/v1", tmp_path).start()
        try:
            rss.append(serve.rss())
            deadline = time.monotonic() + TIME_BUDGET_S
            for wave in range(WAVES):
                batch = [
                    Session(rid(f"soak{wave}-{i}"), f"wave {wave} topic {i}", DIALECTS[i % 4])
                    for i in range(CONCURRENCY)
                ]
                sessions += batch
                wave_s.append(asyncio.run(run_wave(serve.url, batch)))
                rss.append(serve.rss())
                failed = [(s.rollout_id, s.failures) for s in batch if s.failures]
                assert not failed, failed[:3]
                if wave + 1 >= MIN_WAVES and time.monotonic() > deadline:
                    break
        finally:
            serve.stop()
        answers = tap.answers()

    calls = sum(len(s.acks) for s in sessions)
    waves = len(wave_s)
    growth = (rss[-1] - rss[1]) / rss[1]
    print(
        f"soak[{backend}]: {waves} waves x {CONCURRENCY} sessions x {TURNS} calls = {calls} "
        f"calls in {sum(wave_s):.1f} s ({calls / sum(wave_s):.0f}/s); wave seconds "
        f"{[round(w, 1) for w in wave_s]}; RSS MiB {[round(r / 2**20, 1) for r in rss]}; "
        f"growth after warm-up {growth:+.1%}"
    )
    assert waves >= MIN_WAVES
    assert calls == waves * CONCURRENCY * TURNS
    assert len(answers) == calls  # the upstream answered each call exactly once

    ids = [s.rollout_id for s in sessions]
    assert run_async(lambda led: half_written(led, ids), db_url) == []
    counts = check_acks_byte_for_byte(db_url, answers, sessions)
    assert all(counts[s.rollout_id] == TURNS for s in sessions), "a call was recorded twice"

    outcomes: dict[str, int] = {}
    for s, result, build in asyncio.run(finalize_all(db_url, sessions)):
        outcomes[build["outcome"]] = outcomes.get(build["outcome"], 0) + 1
        assert build["outcome"] == "delivered", (s.rollout_id, s.dialect, build["mask_reasons"])
        assert build["metrics"]["delivered_fraction"] == 1.0, build["metrics"]
        assert delivered(result) == expected_chain(answers, s.acks), s.rollout_id
    assert outcomes == {"delivered": len(sessions)}

    # Flat memory: after the warm-up wave the proxy's RSS no longer grows with the calls it
    # has served (a per-call leak of even a few KiB would show over the later waves).
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth:.1%} after warm-up: {rss}"
