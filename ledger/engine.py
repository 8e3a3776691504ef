"""One engine factory per dialect (conventions: habit 5).

SQLite: WAL so readers never block the writer; ``synchronous=FULL`` because an ingest
acknowledgement promises the record survives a power loss, not just a process crash;
``busy_timeout`` so a second process waits for the write lock instead of failing; foreign keys
on (SQLite leaves them off by default); writes open with ``BEGIN IMMEDIATE`` so two writers
serialise at BEGIN instead of deadlocking on a lock upgrade mid-transaction.

Postgres: READ COMMITTED, with every write taking the rollout row's lock (``SELECT … FOR
UPDATE``) first; ``lock_timeout`` and ``statement_timeout`` bound how long a stuck peer can hold
a worker.  A pooled connection is pinged before use only when it sat idle in the pool for
``PG_PING_IDLE_S`` or longer (a dead one is replaced, as SQLAlchemy's ``pool_pre_ping`` would):
``pool_pre_ping`` pings on every checkout, three round trips on asyncpg (BEGIN, the ping,
ROLLBACK), nine per build of a rollout, for connections that were in use a moment ago.
"""

from __future__ import annotations

import os
import sqlite3
import time
from typing import Any

from sqlalchemy import create_engine, event, exc
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

__all__ = [
    "DEFAULT_DB_URL",
    "READ_ONLY",
    "is_sqlite",
    "make_engine",
    "make_sync_engine",
    "normalize_url",
]

DEFAULT_DB_URL = "sqlite+aiosqlite:///rollout-ledger.db"
READ_ONLY = "ledger_read_only"
SQLITE_BUSY_TIMEOUT_MS = int(os.environ.get("ROLLOUT_LEDGER_SQLITE_BUSY_TIMEOUT_MS", "60000"))
# Token rows are 2-4 KiB: on 4 KiB pages most would sit one to a page, half of it unused.
SQLITE_PAGE_SIZE = int(os.environ.get("ROLLOUT_LEDGER_SQLITE_PAGE_SIZE", "8192"))
PG_LOCK_TIMEOUT_MS = int(os.environ.get("ROLLOUT_LEDGER_PG_LOCK_TIMEOUT_MS", "30000"))
PG_STATEMENT_TIMEOUT_MS = int(os.environ.get("ROLLOUT_LEDGER_PG_STATEMENT_TIMEOUT_MS", "120000"))
# Connections per process to Postgres: ``pool_size`` kept open, up to ``max_overflow`` more.
PG_POOL_SIZE = int(os.environ.get("ROLLOUT_LEDGER_PG_POOL_SIZE", "10"))
PG_MAX_OVERFLOW = int(os.environ.get("ROLLOUT_LEDGER_PG_MAX_OVERFLOW", "20"))
# A pooled Postgres connection idle at least this long is pinged before it is handed out.
PG_PING_IDLE_S = float(os.environ.get("ROLLOUT_LEDGER_PG_PING_IDLE_S", "5"))
_IDLE_SINCE = "rollout_ledger_idle_since"


def normalize_url(url: str | URL) -> URL:
    """Accept ``sqlite:///…``/``postgresql://…`` and pick the async driver for them."""
    u = make_url(url) if isinstance(url, str) else url
    if u.drivername in ("sqlite", "sqlite+pysqlite"):
        u = u.set(drivername="sqlite+aiosqlite")
    elif u.drivername in ("postgresql", "postgres", "postgresql+psycopg2", "postgresql+psycopg"):
        u = u.set(drivername="postgresql+asyncpg")
    if u.drivername not in ("sqlite+aiosqlite", "postgresql+asyncpg"):
        raise ValueError(
            f"unsupported database URL {u.render_as_string(hide_password=True)!r}: use "
            "sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DB"
        )
    return u


def is_sqlite(url: str | URL) -> bool:
    return normalize_url(url).get_backend_name() == "sqlite"


def make_engine(url: str | URL, **kwargs: Any) -> AsyncEngine:
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        return _sqlite_engine(u, **kwargs)
    return _postgres_engine(u, **kwargs)


def _sqlite_setup(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the driver so BEGIN is ours to emit.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        # Takes effect only while the file is still empty (before WAL mode is set); an
        # existing database keeps its page size.
        cur.execute(f"PRAGMA page_size={SQLITE_PAGE_SIZE}")
        _ensure_wal(cur)
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get(READ_ONLY):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


def is_lock_error(exc: BaseException) -> bool:
    """SQLite answered busy or locked (another connection holds the lock), by its result code
    (``sqlite_errorcode``, extended codes included); the message text only for an error that
    carries no code."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def _ensure_wal(cur: Any) -> None:
    """Switch a database file to WAL once (the mode persists in the file).

    Switching needs an exclusive lock and SQLite may answer "database is locked" without
    waiting on the busy handler when another process is opening the same new file, so the
    switch is retried until the busy timeout.
    """
    cur.execute("PRAGMA journal_mode")
    row = cur.fetchone()
    if row and str(row[0]).lower() == "wal":
        return
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.005
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.fetchone()
            return
        except Exception as exc:  # sqlite3.OperationalError through either driver
            if not is_lock_error(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)  # only at first connection to a brand-new file
            delay = min(delay * 2, 0.2)


def _sqlite_file(url: URL) -> None:
    if url.database in (None, "", ":memory:"):
        raise ValueError("the ledger needs a SQLite file, not an in-memory database")


def _sqlite_engine(url: URL, **kwargs: Any) -> AsyncEngine:
    _sqlite_file(url)
    connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
    engine = create_async_engine(url, connect_args=connect_args, **kwargs)
    _sqlite_setup(engine.sync_engine)
    return engine


def make_sync_engine(url: str | URL) -> Engine:
    """A synchronous SQLite engine (stdlib driver) for the group-commit writer thread."""
    u = normalize_url(url)
    if u.get_backend_name() != "sqlite":
        raise ValueError("the synchronous writer engine is for SQLite only")
    u = u.set(drivername="sqlite+pysqlite")
    _sqlite_file(u)
    engine = create_engine(
        u,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False},
        pool_size=1,
        max_overflow=0,
    )
    _sqlite_setup(engine)
    return engine


def _postgres_engine(url: URL, **kwargs: Any) -> AsyncEngine:
    settings = {
        "lock_timeout": str(PG_LOCK_TIMEOUT_MS),
        "statement_timeout": str(PG_STATEMENT_TIMEOUT_MS),
        "application_name": "rollout-ledger",
    }
    if "poolclass" not in kwargs:
        kwargs.setdefault("pool_size", PG_POOL_SIZE)
        kwargs.setdefault("max_overflow", PG_MAX_OVERFLOW)
    engine = create_async_engine(
        url,
        isolation_level="READ COMMITTED",
        connect_args={"server_settings": settings},
        **kwargs,
    )
    if not kwargs.get("pool_pre_ping"):
        _ping_when_idle(engine.sync_engine)
    return engine


def _ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection at checkout only when it was idle ``PG_PING_IDLE_S`` or longer;
    a failed ping makes the pool replace it (``DisconnectionError``: the pool retries the
    checkout with a fresh connection).  A connection just opened is not pinged."""

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get(_IDLE_SINCE)
        if since is None or time.monotonic() - since < PG_PING_IDLE_S:
            return
        try:
            dbapi_conn.ping()
        except Exception as error:
            raise exc.DisconnectionError(f"pooled connection failed its ping: {error}") from error
