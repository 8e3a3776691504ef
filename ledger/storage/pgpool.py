"""The Postgres hot path's connections: a small pool handing out asyncpg connections as they are.

asyncpg's own pool wraps every checkout in a proxy object, takes it from an ``asyncio.Queue``
and releases it through a shielded task; on the hot path (an intent and a record per call, one
checkout each) that bookkeeping was about a tenth of the client's CPU per call.  This pool hands
out the connection itself: the most recently used idle one (its statement cache is the warmest),
a new one while fewer than ``max_size`` are open, else the next one released, first come first
served.  A connection goes back only when it is open and outside a transaction; any other is
terminated, and a waiter may open a new one in its place.  The hot path's statements leave no
session state (no SET, cursor, LISTEN or advisory lock), so nothing is reset between checkouts.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

__all__ = ["ConnectionPool"]


class ConnectionPool:
    """Up to ``max_size`` asyncpg connections of one event loop, opened on demand by ``connect``."""

    def __init__(self, connect: Callable[[], Awaitable[Any]], *, max_size: int) -> None:
        self._connect = connect
        self.max_size = max_size
        self._idle: list[Any] = []
        # Waiters get a connection, or None: a slot came free, open one.
        self._waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._open = 0  # connections open or being opened
        self._closed = False

    @property
    def size(self) -> int:
        return self._open

    def acquire(self) -> _Checkout:
        """``async with pool.acquire() as conn``: a connection for the block."""
        return _Checkout(self)

    async def get(self) -> Any:
        while True:
            if self._closed:
                raise RuntimeError("the ledger's Postgres connections are closed")
            while self._idle:
                conn = self._idle.pop()
                if not conn.is_closed():
                    return conn
                self._open -= 1
            if self._open < self.max_size:
                self._open += 1
                try:
                    return await self._connect()
                except BaseException:
                    self._open -= 1
                    self._wake_one(None)
                    raise
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                conn = await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    handed = waiter.result()  # woken as the wait was cancelled: pass it on
                    if handed is not None:
                        self.put(handed)
                    else:
                        self._wake_one(None)
                else:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
                raise
            if conn is not None:
                return conn
            # A slot came free: loop to open a connection (or take one released meanwhile).

    def put(self, conn: Any) -> None:
        """Give a connection back (or terminate it if it is not fit for the next checkout)."""
        if self._closed or conn.is_closed() or conn.is_in_transaction():
            if not conn.is_closed():
                conn.terminate()
            self._open -= 1
            self._wake_one(None)
            return
        if not self._wake_one(conn):
            self._idle.append(conn)

    def _wake_one(self, value: Any) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(value)
                return True
        return False

    async def warm(self, connections: int) -> None:
        """Open up to ``connections`` connections now."""
        held = [await self.get() for _ in range(min(connections, self.max_size))]
        for conn in held:
            self.put(conn)

    async def close(self) -> None:
        """Close the idle connections; those checked out close as they come back."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._open -= 1
            try:
                await conn.close(timeout=5)
            except Exception:
                conn.terminate()
        self._fail_waiters()

    def terminate(self) -> None:
        """Close everything idle at once, without a goodbye (another event loop's pool)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._open -= 1
            conn.terminate()
        self._fail_waiters()

    def _fail_waiters(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(RuntimeError("the ledger's Postgres connections are closed"))


class _Checkout:
    __slots__ = ("_conn", "_pool")

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._conn: Any = None

    async def __aenter__(self) -> Any:
        self._conn = await self._pool.get()
        return self._conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        conn, self._conn = self._conn, None
        self._pool.put(conn)
