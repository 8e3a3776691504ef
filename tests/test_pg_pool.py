"""Postgres pooled connections: pinged before use only after sitting idle, replaced when dead.

The engine pings a pooled connection at checkout only when it sat idle for
``ledger.engine.PG_PING_IDLE_S`` or longer (a build checks out three connections in quick
succession; pinging each costs three round trips on asyncpg)."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger import engine as engine_module
from tests.conftest import require_postgres

pytestmark = pytest.mark.postgres


async def _backend_pid(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one())


async def _terminate(url: str, pid: int) -> None:
    """End backend ``pid`` from a separate session and wait until it is gone."""
    plain = url.replace("postgresql+asyncpg://", "postgresql://")
    admin = await asyncpg.connect(plain)
    try:
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
        for _ in range(200):
            alive = await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
            )
            if not alive:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"backend {pid} still alive")
    finally:
        await admin.close()


async def test_idle_connection_is_pinged_and_a_dead_one_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = require_postgres()
    monkeypatch.setattr(engine_module, "PG_PING_IDLE_S", 0.0)
    engine = engine_module.make_engine(url, pool_size=1, max_overflow=0)
    try:
        first = await _backend_pid(engine)
        await _terminate(url, first)
        # The pooled connection is dead: its ping fails and the pool opens a fresh one.
        second = await _backend_pid(engine)
        assert second != first
        assert await _backend_pid(engine) == second  # and keeps it
    finally:
        await engine.dispose()


async def test_recently_used_connection_is_handed_out_without_a_ping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = require_postgres()
    monkeypatch.setattr(engine_module, "PG_PING_IDLE_S", 3600.0)
    engine = engine_module.make_engine(url, pool_size=1, max_overflow=0)
    try:
        first = await _backend_pid(engine)
        await _terminate(url, first)
        # Not idle long enough to be pinged: the dead connection is used and the statement
        # fails (this is the round trip the idle threshold saves on a live connection) ...
        with pytest.raises(sa.exc.DBAPIError):
            await _backend_pid(engine)
        # ... and the pool, told of the disconnect, replaces it for the next checkout.
        assert await _backend_pid(engine) != first
    finally:
        await engine.dispose()
