"""Where SQLite ingest time goes: the ledger's own SQL, replayed without the async driver.

1. Capture: run the workload through the stock Ledger with group commit off (one transaction per
   write) and record, per write transaction in commit order, every statement SQLAlchemy sent to
   the driver with its parameters, plus the number of driver round trips (aiosqlite hands every
   cursor operation to its worker thread and back).
2. Replay: execute exactly those statements, in the same order, on a fresh database through the
   stdlib ``sqlite3`` module from one thread (WAL, ``synchronous=FULL``, as the ledger configures
   it): once with a commit per write, once grouping ``batch`` writes per commit (each in a
   SAVEPOINT, as the ledger's group commit does).  The data, the reads (lineage proof included)
   and the durability are the same; what is gone is SQLAlchemy's per-statement work, the
   per-statement thread hops and the event loop.  Python-side validation and hashing of the
   records are not in the replay; :func:`cpu_floor` measures them separately.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import event

from bench.dbs import Db, DbFactory
from bench.direct import ingest
from bench.workload import Workload, direct_calls
from ledger.records import coerce_entry
from ledger.storage import ingest as ingest_steps
from ledger.store import Ledger, _prepare

__all__ = ["capture_and_replay", "cpu_floor"]


def _attach_capture(ledger: Ledger) -> tuple[list[list[tuple[str, Any]]], dict[str, int]]:
    """Hook the ledger's engine: transactions (lists of statements) in commit order."""
    done: list[list[tuple[str, Any]]] = []
    open_tx: dict[int, list[tuple[str, Any]]] = {}
    counts = {"statements": 0}
    sync = ledger.engine.sync_engine

    @event.listens_for(sync, "before_cursor_execute")
    def _stmt(conn: Any, _cur: Any, statement: str, params: Any, _ctx: Any, many: bool) -> None:
        counts["statements"] += 1
        if many:
            raise RuntimeError("executemany is not replayed")
        if statement.strip().upper().startswith("BEGIN"):
            open_tx[id(conn.connection)] = []
            return
        open_tx.setdefault(id(conn.connection), []).append((statement, tuple(params or ())))

    @event.listens_for(sync, "commit")
    def _commit(conn: Any) -> None:
        tx = open_tx.pop(id(conn.connection), None)
        if tx:
            done.append(tx)

    @event.listens_for(sync, "rollback")
    def _rollback(conn: Any) -> None:
        open_tx.pop(id(conn.connection), None)

    return done, counts


def _count_driver_hops() -> tuple[dict[str, int], Any]:
    """Count aiosqlite worker-thread round trips (patched for the capture only)."""
    import aiosqlite.core as core

    counter = {"hops": 0}
    original = core.Connection._execute

    async def counted(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        counter["hops"] += 1
        return await original(self, fn, *args, **kwargs)

    core.Connection._execute = counted  # type: ignore[method-assign]

    def restore() -> None:
        core.Connection._execute = original  # type: ignore[method-assign]

    return counter, restore


def _replay(path: Path, txs: list[list[tuple[str, Any]]], batch: int) -> float:
    conn = sqlite3.connect(path, isolation_level=None, timeout=60, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    t0 = time.perf_counter()
    try:
        for i in range(0, len(txs), batch):
            group = txs[i : i + batch]
            conn.execute("BEGIN IMMEDIATE")
            for tx in group:
                if batch > 1:
                    conn.execute("SAVEPOINT w")
                for sql, params in tx:
                    conn.execute(sql, params).fetchall()
                if batch > 1:
                    conn.execute("RELEASE w")
            conn.execute("COMMIT")
    finally:
        elapsed = time.perf_counter() - t0
        conn.close()
    return elapsed


async def capture_and_replay(
    f: DbFactory, w: Workload, *, batches: tuple[int, ...] = (1, 16)
) -> dict[str, Any]:
    src = await f.create("sqlite", "capture")
    try:
        ledger = Ledger(src.url, group_commit=False)
        try:
            # No warm-up: the replay database must see every write from the first one.
            txs, counts = _attach_capture(ledger)
            hops, restore = _count_driver_hops()
            plain = {"statements": 0}

            def count_plain(_sql: str) -> None:
                plain["statements"] += 1

            ingest_steps.OBSERVERS.append(count_plain)
            try:
                t0 = time.perf_counter()
                res = await ingest(ledger, w, prefix="r")
                wall = time.perf_counter() - t0
            finally:
                restore()
                ingest_steps.OBSERVERS.remove(count_plain)
        finally:
            await ledger.close()
    finally:
        await f.drop(src)
    calls = res["calls"]
    if not txs:
        # The ingest hot path runs plain SQL on the driver (ledger.storage), which SQLAlchemy's
        # cursor events do not see: there is nothing left to replay without SQLAlchemy.
        return {
            "calls": calls,
            "skipped": "the hot path already runs plain SQL",
            "plain_statements_per_call": plain["statements"] / calls,
            "replay": {},
        }
    out: dict[str, Any] = {
        "calls": calls,
        "write_transactions": len(txs),
        "statements_per_call": counts["statements"] / calls,
        "driver_round_trips_per_call": hops["hops"] / calls,
        "captured_run_calls_per_s": calls / wall,
        "replay": {},
    }
    for batch in batches:
        dst: Db = await f.create("sqlite", f"replay{batch}")
        try:
            assert dst.path is not None
            seconds = await asyncio.to_thread(_replay, dst.path, txs, batch)
        finally:
            await f.drop(dst)
        out["replay"][str(batch)] = {
            "writes_per_commit": batch,
            "seconds": seconds,
            "calls_per_s": calls / seconds,
            "ms_per_write": seconds * 1e3 / len(txs),
        }
    return out


def cpu_floor(w: Workload) -> dict[str, Any]:
    """Per-call CPU the ledger spends before any SQL (record validation, packing, digests),
    averaged over one rollout of the workload: the event loop's floor per call."""
    total = 0.0
    n = 0
    for c in direct_calls(replace(w, rollouts=1), 0, prefix="cpu"):
        t0 = time.perf_counter()
        _prepare(coerce_entry(c.entry))
        total += time.perf_counter() - t0
        n += 1
    per_call = total / n
    return {"calls": n, "ms_per_call": per_call * 1e3, "calls_per_s_one_core": 1 / per_call}
