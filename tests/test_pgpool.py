"""The Postgres hot path's connection pool (``ledger.storage.pgpool``), on a real Postgres."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from ledger.storage.pgpool import ConnectionPool
from tests.conftest import require_postgres

pytestmark = pytest.mark.postgres


def _pool(max_size: int) -> ConnectionPool:
    dsn = require_postgres().replace("postgresql+asyncpg://", "postgresql://")

    def connect() -> Any:
        return asyncpg.connect(dsn)

    return ConnectionPool(connect, max_size=max_size)


async def test_connections_are_reused_and_bounded() -> None:
    pool = _pool(2)
    try:
        async with pool.acquire() as a:
            pid_a = a.get_server_pid()
        async with pool.acquire() as again:
            assert again.get_server_pid() == pid_a  # the idle one, not a new one
        first, second = await pool.get(), await pool.get()
        assert pool.size == 2
        third = asyncio.ensure_future(pool.get())
        await asyncio.sleep(0.05)
        assert not third.done()  # at the bound: waits for a release
        pool.put(second)
        assert (await third) is second
        pool.put(first)
        pool.put(second)
        assert pool.size == 2
    finally:
        await pool.close()


async def test_a_connection_left_in_a_transaction_is_replaced() -> None:
    pool = _pool(1)
    try:
        conn = await pool.get()
        waiter = asyncio.ensure_future(pool.get())
        await asyncio.sleep(0.05)
        await conn.execute("BEGIN")
        pool.put(conn)  # not fit for the next checkout: terminated, the waiter opens anew
        fresh = await waiter
        assert conn.is_closed() and fresh is not conn
        assert not fresh.is_in_transaction()
        assert await fresh.fetchval("SELECT 1") == 1
        pool.put(fresh)
        assert pool.size == 1
    finally:
        await pool.close()


async def test_a_connection_closed_by_the_server_is_replaced() -> None:
    pool = _pool(1)
    try:
        async with pool.acquire() as conn:
            pid = conn.get_server_pid()
        admin = await asyncpg.connect(require_postgres().replace("+asyncpg", ""))
        try:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
        finally:
            await admin.close()
        for _ in range(100):
            if conn.is_closed():
                break
            await asyncio.sleep(0.02)
        async with pool.acquire() as again:
            assert again.get_server_pid() != pid
            assert await again.fetchval("SELECT 2") == 2
    finally:
        await pool.close()


async def test_a_cancelled_wait_keeps_the_slot() -> None:
    pool = _pool(1)
    try:
        conn = await pool.get()
        waiter = asyncio.ensure_future(pool.get())
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        pool.put(conn)
        async with pool.acquire() as again:  # the one connection, still there
            assert again is conn
        assert pool.size == 1
    finally:
        await pool.close()


async def test_close_fails_waiters_and_refuses_checkouts() -> None:
    pool = _pool(1)
    conn = await pool.get()
    waiter = asyncio.ensure_future(pool.get())
    await asyncio.sleep(0.05)
    await pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        await waiter
    pool.put(conn)  # checked out at close: closed as it comes back
    assert conn.is_closed() and pool.size == 0
    with pytest.raises(RuntimeError, match="closed"):
        await pool.get()
