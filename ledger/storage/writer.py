"""The SQLite group-commit writer: one writer thread, pipelined WAL flushes (design §8)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import sqlite3
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.engine import is_lock_error, make_sync_engine
from ledger.errors import (
    Unavailable,
)
from ledger.storage.translate import _translate_error

_T = TypeVar("_T")


class _GroupCommit:
    """Group commit for SQLite (design §8): concurrent writes share one durable commit.

    The writer holds one synchronous SQLite connection, used by one batch at a time.  A batch
    is every write queued while the previous one was in flight, run in one ``BEGIN IMMEDIATE``
    transaction.  A write that raises before changing anything (a refusal) just fails; one that
    raises after changing rows rolls the batch back, which then runs again with one SAVEPOINT
    per write, so a failing write never takes another's changes with it; a failed commit fails
    every write of the batch.  Nothing is acknowledged before its commit.

    The writer keeps one connection for its lifetime.  A batch of hot-path writes only
    (``raw``: bodies over the DB-API ``sqlite3`` connection, ``ledger.storage.ingest``) runs
    between a plain ``BEGIN IMMEDIATE`` and ``COMMIT`` on it, without SQLAlchemy's transaction
    machinery; any other batch runs through SQLAlchemy on the same connection.

    A batch of hot-path writes runs on the caller's own event loop when it can (one callback
    takes every write that loop queued meanwhile): when the connection is free and no other
    process holds the database's write lock (tried without waiting), the batch commits right
    there, without handing the work to the writer thread and back; otherwise the writer
    thread takes it, and waits for the lock as usual.  The statements are the same either way
    (sub-millisecond for a batch): what moves is only who runs them.  Handing each write to
    another thread cost more than the write: the two threads took turns on the GIL after every
    statement.

    Flushing is pipelined: the connection commits with ``synchronous=NORMAL`` (the WAL frames
    are written, and readable, but not yet flushed) and a flusher thread then ``fdatasync``s
    the WAL file, which is exactly the flush ``synchronous=FULL`` would do inside the commit,
    while the writer already runs the next batch.  A write that promises durability is
    acknowledged only after a flush that began after its commit; one that does not need its own
    flush (an intent: the call's flushed record carries it) is acknowledged at its commit.  The
    WAL is checkpointed into the database with its own flushes, as under ``NORMAL``.
    """

    MAX_BATCH = 256
    # Flusher threads: while one flush is in flight, another can start for later commits, so a
    # durable write waits for about one flush, not for the one in flight and then its own.
    FLUSHERS = 2

    def __init__(self, engine: AsyncEngine) -> None:
        self._url = engine.url
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._flushes: queue.SimpleQueue[list[_Outcome] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._flushers: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        self._engine: Engine | None = None
        self._conn: Connection | None = None  # the writer's, for its lifetime (see _conn_lock)
        self._db_path = os.path.abspath(str(engine.url.database or ""))
        # The connection is used by one batch at a time: the writer thread's or a caller's loop.
        self._conn_lock = threading.Lock()
        # Writes queued on each caller's loop for its next batch there.
        self._pending: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
        self._busy_ms = 0  # the connection's busy_timeout (read when it opens)

    async def submit(
        self, body: Callable[[Any], _T], *, flush: bool = True, raw: bool = False
    ) -> _T:
        """Run ``body`` in the next batch; ``raw``: it takes the DB-API connection instead of
        a SQLAlchemy ``Connection``."""
        self._ensure_thread()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_T] = loop.create_future()
        job: _Job = (body, fut, loop, flush, raw)
        if not raw:
            self._queue.put(job)
        elif (pending := self._pending.get(loop)) is not None:
            pending.append(job)
        else:
            self._pending[loop] = [job]
            loop.call_soon(self._run_pending, loop)
        # Not shielded: a caller cancelled while it waits cancels only this future, which the
        # batch then leaves unsettled (``_settle``); the write itself still runs and commits.
        # A shield cost the caller one more turn of the loop per write.
        return await fut

    def _run_pending(self, loop: asyncio.AbstractEventLoop) -> None:
        """Commit the writes queued on ``loop`` here, if that needs no waiting; else hand them
        to the writer thread."""
        batch = self._pending.pop(loop, [])
        if not batch:
            return
        if self._engine is None or not self._conn_lock.acquire(blocking=False):
            self._hand_over(batch)  # closing, or the writer thread holds the connection
            return
        try:
            committed = self._commit(batch, wait=False)
        finally:
            self._conn_lock.release()
        if not committed:  # another connection holds the write lock: the writer thread waits
            self._hand_over(batch)

    def _hand_over(self, batch: list[_Job]) -> None:
        self._ensure_thread()
        for job in batch:
            self._queue.put(job)

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._engine = make_sync_engine(self._url)
                self._thread = threading.Thread(
                    target=self._run, name="rollout-ledger-writer", daemon=True
                )
                self._flushers = [
                    threading.Thread(
                        target=self._flush_loop, name=f"rollout-ledger-flusher-{i}", daemon=True
                    )
                    for i in range(self.FLUSHERS)
                ]
                for flusher in self._flushers:
                    flusher.start()
                self._thread.start()

    async def close(self) -> None:
        thread, flushers = self._thread, self._flushers
        if thread is None:
            return
        self._queue.put(None)
        await asyncio.to_thread(thread.join)
        for _ in flushers:
            self._flushes.put(None)
        for flusher in flushers:
            await asyncio.to_thread(flusher.join)
        self._thread, self._flushers = None, []
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            with self._conn_lock:
                self._drop_connection()

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            more, stop = _drain(self._queue, self.MAX_BATCH - 1)
            batch = [first, *more]
            with self._conn_lock:
                self._commit(batch)
            if stop:
                return

    def _connection(self) -> Connection:
        """The writer's connection, opened on first use and after a failure dropped it."""
        assert self._engine is not None
        if self._conn is None or self._conn.closed or self._conn.invalidated:
            self._drop_connection()
            conn = self._engine.connect()
            dbapi: Any = conn.connection.dbapi_connection
            # Idempotent and cheap (no I/O); the engine's connect hook sets FULL.
            dbapi.execute("PRAGMA synchronous=NORMAL")
            # The lock wait the engine set up, which a batch tried without waiting restores.
            self._busy_ms = int(dbapi.execute("PRAGMA busy_timeout").fetchone()[0])
            self._conn = conn
        return self._conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _commit(self, batch: list[_Job], *, wait: bool = True) -> bool:
        """Run the batch in one transaction without savepoints; a write that fails after it
        changed something makes the whole transaction roll back and run again with one
        savepoint per write (so each write still succeeds or fails alone).

        ``wait=False`` (a batch of hot-path writes only): if another connection holds the
        write lock, do nothing and return False.  The caller holds ``_conn_lock``."""
        outcomes: list[_Outcome] = []
        try:
            conn = self._connection()
            dbapi: Any = conn.connection.dbapi_connection
            if all(job[4] for job in batch):
                if not self._run_raw(dbapi, batch, outcomes, wait=wait):
                    return False
            else:
                with conn.begin():
                    self._run_batch(conn, dbapi, batch, outcomes)
        except _Replay:
            if not wait:  # the writer thread runs it again, with a savepoint per write
                return False
            self._commit_with_savepoints(batch)
            return True
        except Exception as exc:  # the commit (or the transaction) failed: nothing is durable
            self._drop_connection()
            failure = _translate_error(exc)
            for job in batch:
                _resolve(job, None, failure)
            return True
        self._committed(outcomes)
        return True

    def _run_raw(
        self, dbapi: Any, batch: list[_Job], outcomes: list[_Outcome], *, wait: bool = True
    ) -> bool:
        if wait:
            dbapi.execute("BEGIN IMMEDIATE")
        elif not _begin_now(dbapi, self._busy_ms):
            return False
        try:
            self._run_batch(None, dbapi, batch, outcomes)
            dbapi.execute("COMMIT")
        except BaseException:
            if dbapi.in_transaction:
                with contextlib.suppress(Exception):
                    dbapi.execute("ROLLBACK")
            raise
        return True

    @staticmethod
    def _run_batch(
        conn: Connection | None, dbapi: Any, batch: list[_Job], outcomes: list[_Outcome]
    ) -> None:
        for job in batch:
            changes = dbapi.total_changes
            try:
                outcomes.append((job, job[0](dbapi if job[4] else conn), None))
            except Exception as exc:
                if dbapi.total_changes != changes or not dbapi.in_transaction:
                    raise _Replay from exc
                # It failed before changing anything: nothing to undo.
                outcomes.append((job, None, _translate_error(exc)))

    def _commit_with_savepoints(self, batch: list[_Job]) -> None:
        outcomes: list[_Outcome] = []
        try:
            conn = self._connection()
            dbapi: Any = conn.connection.dbapi_connection
            with conn.begin():
                for job in batch:
                    try:
                        with conn.begin_nested():
                            value = job[0](dbapi if job[4] else conn)
                        outcomes.append((job, value, None))
                    except Exception as exc:  # this write alone rolls back to its savepoint
                        outcomes.append((job, None, _translate_error(exc)))
        except Exception as exc:  # the commit (or the transaction) failed: nothing is durable
            self._drop_connection()
            failure = _translate_error(exc)
            for job in batch:
                _resolve(job, None, failure)
            return
        self._committed(outcomes)

    def _committed(self, outcomes: list[_Outcome]) -> None:
        """Acknowledge what needs no flush now; hand the rest to the flusher."""
        waiting: list[_Outcome] = []
        now: list[_Outcome] = []
        for out in outcomes:
            job, _value, error = out
            (waiting if job[3] and error is None else now).append(out)
        _resolve_all(now)
        if waiting:
            self._flushes.put(waiting)

    def _flush_loop(self) -> None:
        while True:
            first = self._flushes.get()
            if first is None:
                return
            more, stop = _drain(self._flushes)
            waiting = [out for outs in (first, *more) for out in outs]
            try:
                self._flush_wal()
            except OSError as exc:
                failure = Unavailable(f"ledger database unavailable: flush failed: {exc}")
                for job, _value, _error in waiting:
                    _resolve(job, None, failure)
            else:
                _resolve_all(waiting)
            if stop:
                return

    def _flush_wal(self) -> None:
        """``fdatasync`` the WAL (what a ``synchronous=FULL`` commit does); when there is no WAL
        file (checkpointed and removed), the database file holds the commits: flush it."""
        for path in (self._db_path + "-wal", self._db_path):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            return


# (body, future, the caller's loop, whether its commit must wait for the flush, whether the body
# takes the DB-API connection)
_Job = tuple[Callable[[Any], Any], "asyncio.Future[Any]", asyncio.AbstractEventLoop, bool, bool]


_Outcome = tuple[_Job, Any, BaseException | None]


def _drain(
    q: queue.SimpleQueue[Any] | queue.Queue[Any], limit: int | None = None
) -> tuple[list[Any], bool]:
    """What is queued now (up to ``limit`` items) without waiting, and whether the stop
    sentinel (``None``) was among it (nothing after it is taken)."""
    items: list[Any] = []
    while limit is None or len(items) < limit:
        try:
            item = q.get_nowait()
        except queue.Empty:
            break
        if item is None:
            return items, True
        items.append(item)
    return items, False


def _begin_now(dbapi: Any, busy_ms: int) -> bool:
    """``BEGIN IMMEDIATE`` without waiting for the write lock: False when another connection
    holds it (the caller then leaves the batch to the writer thread, which waits).  The
    connection's own lock wait (``busy_ms``) is put back either way."""
    dbapi.execute("PRAGMA busy_timeout = 0")
    try:
        dbapi.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if dbapi.in_transaction or not is_lock_error(exc):
            raise
        return False
    finally:
        dbapi.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
    return True


class _Replay(Exception):
    """A write failed after changing rows: roll the batch back and rerun it with savepoints."""


def _settle(outcomes: list[_Outcome]) -> None:
    """Set each caller's future (on the caller's own loop); a future already done is left."""
    for job, value, error in outcomes:
        fut = job[1]
        if fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)


def _resolve_all(outcomes: list[_Outcome]) -> None:
    """Settle outcomes with one wake-up of each caller's loop (not one per write)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
    for out in outcomes:
        by_loop.setdefault(out[0][2], []).append(out)
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # the writer or a flusher thread
        here = None
    for loop, outs in by_loop.items():
        if loop is here:  # a batch run on the caller's own loop: settle now
            _settle(outs)
            continue
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody is waiting
            loop.call_soon_threadsafe(_settle, outs)


def _resolve(job: _Job, value: Any, error: BaseException | None) -> None:
    _resolve_all([(job, value, error)])
