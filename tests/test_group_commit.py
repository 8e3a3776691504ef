"""The SQLite group-commit writer (issue 12): batches without per-write savepoints, commits
flushed behind the writer, a hot-path batch committed on the caller's loop when nothing is
held.  SQLite only: Postgres has no group-commit writer (one transaction per write, the server
groups its WAL flushes)."""

from __future__ import annotations

import asyncio
import gc
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ledger import migrate
from ledger.errors import NotFound, Unavailable
from ledger.store import Ledger
from tests.test_promises import rec


@pytest.fixture
async def sqlite_ledger(tmp_path: Path) -> Ledger:
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    migrate.upgrade(url)
    return Ledger(url)


async def test_a_write_that_fails_after_changing_rows_takes_nothing_else_with_it(
    sqlite_ledger: Ledger,
) -> None:
    led = sqlite_ledger
    try:

        def half_done(conn: Connection) -> None:
            conn.execute(
                sa.text(
                    "INSERT INTO rollouts (rollout_id, state, incomplete, version, created_at, "
                    "updated_at) VALUES ('junk', 'open', 0, 0, '2026-01-01', '2026-01-01')"
                )
            )
            raise RuntimeError("failed after a write")

        # Submitted together, so they usually share a batch; the outcome must not depend on it.
        results = await asyncio.gather(
            led.begin_call("r1", "c1"),
            led._transact(half_done),
            led.put(rec("r1", "c1", [1, 2, 3], [4])),
            led.put(rec("r2", "c1", [1, 2, 3], [5])),
            return_exceptions=True,
        )
        assert results[0] is True
        assert isinstance(results[1], RuntimeError)
        assert [r.status for r in results[2:]] == ["created", "created"]  # type: ignore[union-attr]
        with pytest.raises(NotFound):
            await led.get_state("junk")
        assert (await led.get_state("r1")).version == 1
        snap = await led.freeze("r2")
        assert [e.generation_token_ids for e in snap.entries] == [[5]]
    finally:
        await led.close()


async def test_refusals_in_a_batch_leave_the_other_writes_committed(
    sqlite_ledger: Ledger,
) -> None:
    led = sqlite_ledger
    try:
        await led.put(rec("closed", "c1", [1], [2]))
        await led.freeze_state("closed")
        results = await asyncio.gather(
            *(led.put(rec("closed", f"late{i}", [1, 2], [3])) for i in range(3)),
            *(led.put(rec(f"open{i}", "c1", [1, 2], [3])) for i in range(3)),
            return_exceptions=True,
        )
        assert all(type(r).__name__ == "RolloutFrozen" for r in results[:3])
        assert [r.status for r in results[3:]] == ["created"] * 3  # type: ignore[union-attr]
        for i in range(3):
            assert len((await led.freeze(f"open{i}")).entries) == 1
    finally:
        await led.close()


async def test_writes_survive_a_new_ledger_on_the_same_file(sqlite_ledger: Ledger) -> None:
    led = sqlite_ledger
    await asyncio.gather(*(led.put(rec(f"d{i}", "c1", [1, 2], [i + 3])) for i in range(20)))
    await led.close()
    again = Ledger(led.url)
    try:
        for i in range(20):
            assert (await again.get_state(f"d{i}")).version == 1
    finally:
        await again.close()


def _runner(name: str) -> Any:
    """A hot-path write (DB-API body) that stores one row and says which thread ran it."""

    def body(dbapi: Any) -> str:
        dbapi.execute(
            "INSERT INTO rollouts (rollout_id, state, incomplete, version, created_at, "
            "updated_at) VALUES (?, 'open', 0, 0, '2026-01-01', '2026-01-01')",
            (name,),
        )
        return threading.current_thread().name

    return body


async def test_hot_path_writes_commit_on_the_callers_loop_when_nothing_is_held(
    sqlite_ledger: Ledger,
) -> None:
    """Writes queued on one loop commit together, on that loop's own thread, when the
    connection and the database's write lock are free; the writer thread is not involved."""
    led = sqlite_ledger
    try:
        group = led._group
        assert group is not None
        ran = await asyncio.gather(*(group.submit(_runner(f"here{i}"), raw=True) for i in range(5)))
        assert set(ran) == {threading.current_thread().name}
        for i in range(5):
            assert (await led.get_state(f"here{i}")).state == "open"
    finally:
        await led.close()


async def test_a_caller_cancelled_while_its_write_waits_leaves_the_write_to_commit(
    sqlite_ledger: Ledger,
) -> None:
    """Cancelling a caller that waits on its write cancels only its wait: the intent and the
    record it submitted still commit (a repeat of the record is a duplicate), a conflicting
    record is still refused and marked, its error is not left unretrieved, and the write queued
    beside them is answered as usual."""
    led = sqlite_ledger
    unretrieved: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    try:
        await led.begin_call("r1", "c0")
        await led.put(rec("r1", "c0", [1, 2, 3], [4]))
        await led.begin_call("r2", "c1")
        await led.put(rec("r2", "c1", [1, 2, 3], [9]))
        await led.begin_call("r4", "c1")
        intent = asyncio.ensure_future(led.begin_call("r1", "c1"))
        record = asyncio.ensure_future(led.put(rec("r4", "c1", [1, 2, 3], [7])))
        conflict = asyncio.ensure_future(led.put(rec("r2", "c1", [1, 2, 3], [8])))
        beside = asyncio.ensure_future(led.begin_call("r3", "c1"))
        await asyncio.sleep(0)  # each task runs to its write's wait; the batch runs next turn
        group = led._group
        assert group is not None
        assert len(group._pending[loop]) == 4
        for task in (intent, record, conflict):
            task.cancel()
        assert await beside is True
        for task in (intent, record, conflict):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await led.begin_call("r1", "c1") is False  # the cancelled intent committed
        again = await led.put(rec("r4", "c1", [1, 2, 3], [7]))
        assert again.status == "duplicate"  # the cancelled record committed
        assert not (await led.get_state("r4")).incomplete
        state = await led.get_state("r2")
        assert state.incomplete  # the cancelled conflicting record was still refused and marked
        await asyncio.sleep(0.05)  # any flush settling the cancelled waits lands meanwhile
        gc.collect()
        assert unretrieved == []
    finally:
        loop.set_exception_handler(None)
        await led.close()


async def test_a_write_lock_held_elsewhere_moves_the_batch_to_the_writer_thread(
    sqlite_ledger: Ledger, tmp_path: Path
) -> None:
    """While another connection holds the write lock, hot-path writes neither fail nor block
    the event loop: the writer thread waits for the lock and commits them once it is free."""
    led = sqlite_ledger
    try:
        group = led._group
        assert group is not None
        await group.submit(_runner("warm"), raw=True)  # the writer's connection is open
        other = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None, timeout=30)
        other.execute("BEGIN IMMEDIATE")
        try:
            writes = asyncio.ensure_future(
                asyncio.gather(*(group.submit(_runner(f"held{i}"), raw=True) for i in range(3)))
            )
            ticks = 0
            for _ in range(20):  # the loop keeps running while the lock is held
                await asyncio.sleep(0.01)
                ticks += 1
            assert ticks == 20 and not writes.done()
        finally:
            other.execute("COMMIT")
            other.close()
        ran = await asyncio.wait_for(writes, 30)
        assert set(ran) == {"rollout-ledger-writer"}
        for i in range(3):
            assert (await led.get_state(f"held{i}")).state == "open"
    finally:
        await led.close()


async def test_a_write_failing_after_changes_on_the_loop_takes_nothing_else_with_it(
    sqlite_ledger: Ledger,
) -> None:
    """A batch run on the caller's loop in which one write fails after changing rows is rolled
    back and run again by the writer thread, a savepoint per write: the failing write alone
    fails."""
    led = sqlite_ledger
    try:
        group = led._group
        assert group is not None

        def half_done(dbapi: Any) -> None:
            _runner("junk")(dbapi)
            raise RuntimeError("failed after a write")

        results = await asyncio.gather(
            group.submit(_runner("kept1"), raw=True),
            group.submit(half_done, raw=True),
            group.submit(_runner("kept2"), raw=True),
            return_exceptions=True,
        )
        assert isinstance(results[1], RuntimeError)
        assert results[0] == results[2] == "rollout-ledger-writer"
        with pytest.raises(NotFound):
            await led.get_state("junk")
        for name in ("kept1", "kept2"):
            assert (await led.get_state(name)).state == "open"
    finally:
        await led.close()


async def test_a_write_tried_without_waiting_leaves_the_connections_lock_wait_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trying the write lock without waiting sets the connection's busy timeout to 0 for that
    one attempt; the engine's own setting (here a short one) is what the writer thread then
    waits with, and what the connection keeps."""
    import ledger.engine

    monkeypatch.setattr(ledger.engine, "SQLITE_BUSY_TIMEOUT_MS", 1234)
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
    migrate.upgrade(url)
    led = Ledger(url)
    try:
        group = led._group
        assert group is not None
        await group.submit(_runner("warm"), raw=True)
        other = sqlite3.connect(tmp_path / "ledger.db", isolation_level=None, timeout=30)
        other.execute("BEGIN IMMEDIATE")
        try:
            started = time.monotonic()
            with pytest.raises(Unavailable):  # the writer thread gave up after 1.234 s
                await asyncio.wait_for(group.submit(_runner("late"), raw=True), 20)
            assert time.monotonic() - started < 10  # not the production minute
        finally:
            other.execute("ROLLBACK")
            other.close()
        await group.submit(_runner("after"), raw=True)  # the lock is free: on the loop again
        assert group._conn is not None
        dbapi: Any = group._conn.connection.dbapi_connection
        assert dbapi.execute("PRAGMA busy_timeout").fetchone()[0] == 1234
    finally:
        await led.close()


def test_lock_errors_are_told_by_sqlites_result_code(tmp_path: Path) -> None:
    """The writer hands a batch over (and the WAL switch retries) only when SQLite says the
    database is busy or locked: told by the result code a real lock produces, not its text."""
    from ledger.engine import is_lock_error

    path = tmp_path / "lock.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA journal_mode=WAL")
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        with pytest.raises(sqlite3.OperationalError) as busy:
            other.execute("BEGIN IMMEDIATE")
        assert busy.value.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
        assert is_lock_error(busy.value)
        with pytest.raises(sqlite3.OperationalError) as syntax:
            other.execute("SELEC 1")
        assert not is_lock_error(syntax.value)
        # A message that merely mentions a lock is not one, when the code says otherwise.
        with pytest.raises(sqlite3.OperationalError) as missing:
            other.execute("SELECT * FROM locked_busy_table")
        assert "locked" in str(missing.value) and not is_lock_error(missing.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        other.close()
