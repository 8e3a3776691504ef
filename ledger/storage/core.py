"""The ledger's engine side: connections, transactions (SQLite group commit, asyncpg pools),
the rollout row lock and version bump every room builds on, and the shared validators.

Every operation touches exactly one rollout and runs in one transaction that first takes that
rollout's lock (``SELECT … FOR UPDATE`` on Postgres; ``BEGIN IMMEDIATE`` on SQLite), so state
checks and the writes that depend on them cannot interleave with another writer.  The rooms
(``capture``, ``lineage``, ``snapshot``, ``lifecycle``) are mixins over :class:`LedgerCore`;
``ledger.storage.ledger.Ledger`` joins them.  Refusals raise ``ledger.errors``."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger.engine import READ_ONLY, make_engine
from ledger.errors import (
    InvalidInput,
    LedgerError,
    RolloutFrozen,
    RolloutRetired,
    Unavailable,
)
from ledger.ids import MAX_CALL_ID_LEN, is_valid_id
from ledger.records import TokenEntry
from ledger.storage import ingest, queries
from ledger.storage.dialect import SqlDialect, sql_dialect
from ledger.storage.pgpool import ConnectionPool
from ledger.storage.results import RolloutState
from ledger.storage.tips import Heads, TipCache
from ledger.storage.translate import _translate_error, _translate_pg_error
from ledger.storage.writer import _GroupCommit

_T = TypeVar("_T")
_REASON_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# Arrays above this many tokens are packed and hashed in a worker thread (keeps the loop free).
_OFFLOAD_TOKENS = 20_000
# A NeMo Gym delta record brings only its new tokens; what grows with its context is hashing
# Gym's digest of the whole sequence (8 bytes a token, about 4 us per 1,000 tokens at 2 GB/s).
# It goes to a worker thread only where that would hold the loop for about a millisecond: below
# that, the hand-off to the thread and back costs about as much as the hashing it moves.
_OFFLOAD_DELTA_TOKENS = 250_000


# The record packed and hashed once (``ledger.storage.ingest``); kept under the old names.
_Prepared = ingest.Prepared


def _prepare(entry: TokenEntry, tips: TipCache | None = None) -> _Prepared:
    """Pack and hash a record (pure CPU; may run in a worker thread)."""
    return ingest.prepare(entry, tips)


def _validate_reason(reason: str) -> str:
    if not isinstance(reason, str) or not _REASON_RE.match(reason):
        raise InvalidInput(
            f"reason must be a short snake_case word (a-z, 0-9, _; at most 64); got {reason!r}"
        )
    return reason


def _storable_call_id(model_call_id: object, detail: str) -> tuple[str, str]:
    """The form of any call id an incomplete event can store, and the detail to store with it.

    A valid id is kept as is.  Anything else (a ``put`` may have refused it) is kept readable
    and bounded: NUL and lone surrogates, which neither database stores, are escaped, the text
    is cut to the column's 200 characters, and the full original goes into the detail.
    """
    text = model_call_id if isinstance(model_call_id, str) else repr(model_call_id)
    if not text or is_valid_id(text, MAX_CALL_ID_LEN):
        return text, detail
    storable = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if storable == text and len(text) <= MAX_CALL_ID_LEN:
        return text, detail
    note = f"model_call_id as sent: {storable[:1000]!r}"
    return storable[:MAX_CALL_ID_LEN], f"{detail}; {note}" if detail else note


class LedgerCore:
    """The engine side of one ledger (a SQLite file or a Postgres database)."""

    def __init__(
        self,
        url: str,
        *,
        delta_records: bool = True,
        auto_migrate: bool = False,
        group_commit: bool | None = None,
        engine: AsyncEngine | None = None,
        flush_intents: bool = False,
        check_schema: bool = False,
    ):
        self.engine = engine or make_engine(url)
        self.url = url
        self.delta_records = delta_records
        self.auto_migrate = auto_migrate or check_schema
        self._may_migrate = auto_migrate
        # ``check_schema``: refuse (``NoLedger``) instead of creating or migrating a ledger; for
        # every client that is not ``db upgrade`` or ``serve`` (issue 13 item 9).
        # An intent's commit need not wait for its own flush: the call's next write (record,
        # cancel or incomplete mark) is flushed before the harness is answered and, later in
        # the same sequential log (SQLite WAL, Postgres WAL), makes the intent durable with it.
        # A process crash never loses a committed intent either way.
        self.flush_intents = flush_intents
        self.dialect = self.engine.dialect.name
        # The SQL pieces this engine's dialect spells its own way (``ledger.storage.dialect``).
        self.sql: SqlDialect = sql_dialect(self.dialect)

        self._schema_ready = False
        self._schema_lock = asyncio.Lock()
        if group_commit is None:
            group_commit = self.dialect == "sqlite"
        self._group = _GroupCommit(self.engine) if group_commit else None
        # Digest state of each rollout's latest calls: continuations hash only their suffix.
        self._tips = TipCache()
        # Postgres's optimistic record: the version its last write left each rollout at.
        self._heads = Heads()
        # Postgres hot path: asyncpg directly (prepared statements), pools per event loop.
        self._pools: dict[bool, ConnectionPool] = {}
        self._pool_loop: asyncio.AbstractEventLoop | None = None
        self._pool_lock = asyncio.Lock()

    async def close(self) -> None:
        if self._group is not None:
            await self._group.close()
        await self._close_pool()
        await self.engine.dispose()

    async def _close_pool(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            if self._pool_loop is asyncio.get_running_loop():
                await pool.close()
            else:
                pool.terminate()

    async def warm_up(self, connections: int = 1) -> None:
        """Check the schema and, on Postgres, open up to ``connections`` hot-path connections
        in each pool now, not as the first calls arrive (a serving ledger already has them)."""
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        if self.dialect != "postgresql":
            return
        for lazy in (False, True):
            await (await self._pg_pool(lazy=lazy)).warm(connections)

    async def ensure_schema(self) -> None:
        """Migrate the database to head once per process (guarded against concurrent runs)."""
        if self._schema_ready:
            return
        async with self._schema_lock:
            if not self._schema_ready:
                from ledger import migrate

                if not self._may_migrate:
                    from ledger.presence import require_ledger

                    await require_ledger(self.url)
                elif await migrate.current_revision(self.url) != migrate.head_revision():
                    # Alembic's env runs its own event loop: give it a thread.
                    await asyncio.to_thread(migrate.upgrade, self.url)
                self._schema_ready = True

    # ----------------------------------------------------------------- transactions

    @contextlib.asynccontextmanager
    async def _translate(self) -> AsyncIterator[None]:
        """Translate driver errors into the ledger's tree, once."""
        try:
            yield
        except LedgerError:
            raise
        except Exception as exc:
            translated = _translate_error(exc)
            if translated is exc:
                raise
            raise translated from exc

    async def _transact(self, body: Callable[[Connection], _T], *, flush: bool = True) -> _T:
        """Run ``body`` in one write transaction and return only after it committed.

        Bodies are synchronous functions over a ``Connection``: on Postgres they run through
        asyncpg (``run_sync``); on SQLite they run in the group-commit writer thread, which
        shares one durable commit among concurrent writers.  ``flush=False`` (SQLite's writer
        only): the commit may skip its own flush when no other write of its batch needs one.
        """
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        if self._group is not None:
            return await self._group.submit(body, flush=flush)
        async with self._write() as aconn:
            return await aconn.run_sync(body)

    async def _run_steps(
        self,
        make: Callable[[bool], ingest.Steps],
        *,
        flush: bool = True,
        single: bool = False,
        optimistic: Sequence[Callable[[], ingest.Steps]] = (),
    ) -> Any:
        """Run one hot-path operation (``ledger.storage.ingest``) and return after its commit
        (``flush=False``: a commit that need not wait for its own flush).

        SQLite: one write transaction in the group-commit writer.  Postgres: asyncpg with its
        statements folded (``make(True)``), in one transaction, or (``single``: an operation
        whose every statement is atomic on its own) in autocommit, one round trip per statement.
        ``optimistic`` (Postgres): first try these forms in autocommit, in order (reads without
        the lock, then one guarded write); one that answers ``ingest.NEED_LOCK`` wrote nothing,
        and the next runs, the locked transaction last.
        """
        if self.dialect == "sqlite":
            if self._group is None:
                return await self._transact(
                    lambda conn: ingest.run_sqlite(conn.connection.dbapi_connection, make(False)),
                    flush=flush,
                )
            if self.auto_migrate and not self._schema_ready:
                await self.ensure_schema()
            return await self._group.submit(
                lambda dbapi: ingest.run_sqlite(dbapi, make(False)), flush=flush, raw=True
            )
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        pool = await self._pg_pool(lazy=not flush)
        try:
            async with pool.acquire() as conn:
                for attempt in optimistic:
                    out = await ingest.run_postgres(conn, attempt())
                    if out is not ingest.NEED_LOCK:
                        return out
                if single:
                    return await ingest.run_postgres(conn, make(True))
                async with conn.transaction():
                    return await ingest.run_postgres(conn, make(True))
        except LedgerError:
            raise
        except Exception as exc:
            translated = _translate_pg_error(exc)
            if translated is exc:
                raise
            raise translated from exc

    async def _pg_pool(self, *, lazy: bool = False) -> ConnectionPool:
        """The hot path's connections (``ledger.storage.pgpool``) on this event loop; ``lazy``:
        their sessions commit without waiting for the WAL flush (``synchronous_commit=off``),
        for intents."""
        loop = asyncio.get_running_loop()
        if self._pool_loop is not loop or lazy not in self._pools:
            async with self._pool_lock:
                if self._pool_loop is not loop:
                    for stale in self._pools.values():
                        stale.terminate()
                    self._pools = {}
                    self._pool_loop = loop
                if lazy not in self._pools:
                    self._pools[lazy] = await self._new_pool(lazy)
        return self._pools[lazy]

    async def _new_pool(self, lazy: bool) -> ConnectionPool:
        import asyncpg

        from ledger.engine import PG_LOCK_TIMEOUT_MS, PG_STATEMENT_TIMEOUT_MS

        settings = {
            "lock_timeout": str(PG_LOCK_TIMEOUT_MS),
            "statement_timeout": str(PG_STATEMENT_TIMEOUT_MS),
            "application_name": "rollout-ledger",
        }
        if lazy:
            settings["synchronous_commit"] = "off"
        dsn = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)

        def connect() -> Any:
            return asyncpg.connect(dsn, server_settings=settings)

        pool = ConnectionPool(connect, max_size=4 if lazy else 10)
        try:
            await pool.warm(1)  # the database is reachable now, or unavailable
        except Exception as exc:
            raise Unavailable(f"ledger database unavailable: {exc}") from exc
        return pool

    def _now(self) -> Any:
        return self.sql.now()

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        async with self._translate(), self.engine.begin() as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        async with self._translate(), self.engine.connect() as conn:
            conn = await conn.execution_options(**{READ_ONLY: True})
            async with conn.begin():
                yield conn

    def _lock_rollout(self, conn: Connection, rollout_id: str) -> RolloutState:
        """Create the rollout row if needed and lock it for the rest of the transaction.

        The row usually exists (freeze, delivery rows and retire come after ingest): it is
        locked and read first, in one statement; only a missing row costs the insert and a
        second locking read."""
        head = self.sql.for_update(queries.rollout_head(rollout_id))
        row = conn.execute(head).one_or_none()
        if row is None:
            conn.execute(queries.create_rollout(self.sql, rollout_id))
            row = conn.execute(head).one()
        return _state_of(rollout_id, row)

    def _bump(self, conn: Connection, rollout_id: str, **values: Any) -> int:
        row = conn.execute(queries.bump_version(rollout_id, **values)).one()
        return int(row.version)

    def _add_incomplete(
        self, conn: Connection, rollout_id: str, call_id: str, reason: str, detail: str
    ) -> int:
        conn.execute(queries.add_incomplete_event(rollout_id, call_id, reason, detail[:4000]))
        return self._bump(conn, rollout_id, incomplete=True)

    @staticmethod
    def _refuse_if_closed(state: RolloutState, what: str) -> None:
        if state.state == "retired":
            raise RolloutRetired(
                f"token capture for rollout {state.rollout_id} is retired; {what} refused",
                rollout_id=state.rollout_id,
            )
        if state.state == "frozen":
            raise RolloutFrozen(
                f"token capture for rollout {state.rollout_id} is already frozen; {what} refused",
                rollout_id=state.rollout_id,
            )


def _state_of(rollout_id: str, head: Any) -> RolloutState:
    """The rollout's state from its ``queries.rollout_head`` row."""
    return RolloutState(rollout_id, head.state, head.incomplete, head.snapshot_id, head.version)


def _failed_attempt(extra: Any) -> dict[str, Any]:
    """The failed-attempt note of an intent row's ``extra`` (empty when there is none)."""
    note = extra.get("failed_attempt") if isinstance(extra, dict) else None
    return note if isinstance(note, dict) else {}
