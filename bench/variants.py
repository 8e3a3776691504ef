"""Ledger variants the benchmark measures.  Only ``stock`` is the shipped behaviour; the others
are prototypes (or diagnostics) built around ``Ledger`` here, never by editing it.

``stock``
    ``ledger.store.Ledger`` as configured: SQLite WAL + ``synchronous=FULL`` with the ledger's
    group commit (concurrent writes share one durable commit, each acknowledged after it);
    Postgres ``synchronous_commit=on``, one transaction per write.
``timed``
    stock, plus per-method wall-clock accounting (for the proxy-overhead breakdown).
``nogroup`` (SQLite)
    ``Ledger(group_commit=False)``: every write transaction is its own durable commit.
``flushintent``
    ``Ledger(flush_intents=True)``: the pre-dispatch intent's commit waits for its own flush
    (the default before issue 12; the stock ledger lets the call's flushed record commit carry
    it).
``nosync`` (SQLite, diagnostic only, NOT durable)
    ``synchronous=OFF`` (group commit kept): what the same code costs without any flush.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.engine import make_engine
from ledger.store import Ledger

__all__ = ["KINDS", "TimedLedger", "make_ledger"]

KINDS = ("stock", "timed", "nogroup", "flushintent", "nosync")
_T = TypeVar("_T")


def _sqlite_engine_with(url: str, synchronous: str) -> AsyncEngine:
    engine = make_engine(url)

    @event.listens_for(engine.sync_engine, "connect")
    def _sync(dbapi_conn: Any, _record: Any) -> None:  # runs after the ledger's own hook
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.close()

    return engine


class TimedLedger(Ledger):
    """Stock ledger that accumulates wall time per public method (``timings``, ms lists)."""

    def __init__(self, url: str, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.timings: dict[str, list[float]] = {}

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*a, **kw)
            finally:
                self.timings.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

        return run

    async def begin_call(self, *a: Any, **kw: Any) -> Any:
        return await self._timed("begin_call", super().begin_call)(*a, **kw)

    async def put(self, *a: Any, **kw: Any) -> Any:
        return await self._timed("put", super().put)(*a, **kw)

    async def freeze_views(self, *a: Any, **kw: Any) -> Any:
        return await self._timed("freeze_views", super().freeze_views)(*a, **kw)

    async def load_chain(self, *a: Any, **kw: Any) -> Any:
        return await self._timed("load_chain", super().load_chain)(*a, **kw)

    async def record_delivery(self, *a: Any, **kw: Any) -> Any:
        return await self._timed("record_delivery", super().record_delivery)(*a, **kw)

    async def mark_delivery(self, *a: Any, **kw: Any) -> Any:
        return await self._timed("mark_delivery", super().mark_delivery)(*a, **kw)


def count_batches(ledger: Ledger) -> list[int]:
    """Record the size of every group-commit batch (a diagnostic hook on the ledger's writer)."""
    sizes: list[int] = []
    group = getattr(ledger, "_group", None)
    commit = getattr(group, "_commit", None)
    if group is None or commit is None:
        return sizes

    def counted(batch: list[Any], **kw: Any) -> Any:  # the writer thread or a caller's loop
        committed = commit(batch, **kw)
        if committed is not False:  # False: not run here (handed to the writer thread)
            sizes.append(len(batch))
        return committed

    group._commit = counted
    return sizes


def make_ledger(kind: str, url: str) -> Ledger:
    """A ledger of the given variant, with ``batch_sizes`` (group-commit batches) attached."""
    ledger: Ledger
    if kind == "stock":
        ledger = Ledger(url)
    elif kind == "timed":
        ledger = TimedLedger(url)
    elif kind == "nogroup":
        ledger = Ledger(url, group_commit=False)
    elif kind == "flushintent":
        ledger = Ledger(url, flush_intents=True)
    elif kind == "nosync":
        # Without group commit, so every write goes through this unflushed engine.
        ledger = Ledger(url, group_commit=False, engine=_sqlite_engine_with(url, "OFF"))
    else:
        raise ValueError(f"unknown ledger variant {kind!r}; choose from {', '.join(KINDS)}")
    ledger.batch_sizes = count_batches(ledger)  # type: ignore[attr-defined]
    return ledger
