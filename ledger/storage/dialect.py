"""The pieces of SQL that differ between SQLite and Postgres, chosen once per engine.

Prefect's ``QueryComponents`` pattern: one small object per dialect answers the few questions
whose SQL is not the same on both databases (an insert that may skip a conflicting row, a row
lock, an element test on a JSON array, a timestamp as epoch seconds, the hot path's "now").
``LedgerCore`` picks its object once (``sql_dialect(engine.dialect.name)``) and the query
builders of ``ledger.storage.queries`` take it as an argument, so no query module branches on
the dialect's name.  The ingest hot path (``statements``, ``ingest``) keeps its own two texts
per statement.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.dialects.postgresql import JSONB

from ledger.storage import ingest
from ledger.tables import utcnow

__all__ = ["PostgresDialect", "SqlDialect", "SqliteDialect", "sql_dialect"]


class SqlDialect(ABC):
    """What one database spells its own way; every method returns a SQLAlchemy construct."""

    name: ClassVar[str]
    # A lone statement (a read, or a write atomic by itself) runs in autocommit, without BEGIN
    # and COMMIT around it (Postgres: one statement is one consistent snapshot and one atomic
    # write; the usual delivery row goes through the hot path's asyncpg connections); SQLite
    # runs it in a transaction of its own.
    lone_statements_in_autocommit: ClassVar[bool] = False
    # Records are written optimistically (``ledger.storage.ingest.put_steps``): reads without
    # the rollout's lock, then one write guarded by its version, the rollout heads this ledger
    # wrote remembered (Postgres: the lock is a round trip; SQLite's writer already holds the
    # database's write lock, so there is nothing to save).
    optimistic_records: ClassVar[bool] = False

    @abstractmethod
    def insert(self, table: sa.Table) -> Any:
        """An ``INSERT`` into ``table`` that knows ``ON CONFLICT`` (``on_conflict_do_nothing``)."""

    def insert_or_skip(
        self, table: sa.Table, conflict_columns: Sequence[str], **values: Any
    ) -> Any:
        """Insert one row unless a row with the same ``conflict_columns`` exists (no error)."""
        return (
            self.insert(table)
            .values(**values)
            .on_conflict_do_nothing(index_elements=conflict_columns)
        )

    @abstractmethod
    def for_update(self, query: sa.Select[Any]) -> sa.Select[Any]:
        """``query`` locking the rows it reads for the rest of the write transaction."""

    @abstractmethod
    def json_array_holds(self, column: Any, value: str, path: str | None = None) -> Any:
        """The JSON array in ``column`` (at ``path``, e.g. ``$.incomplete_reasons``) holds
        ``value`` as an element: an exact match, in SQL."""

    @abstractmethod
    def epoch_seconds(self, column: Any) -> Any:
        """A stored UTC timestamp as whole seconds since the epoch (a BIGINT)."""

    @abstractmethod
    def now(self) -> Any:
        """Now, bound as the hot path's plain SQL stores a ``DateTime`` column."""


class PostgresDialect(SqlDialect):
    name = "postgresql"
    lone_statements_in_autocommit = True
    optimistic_records = True

    def insert(self, table: sa.Table) -> Any:
        return postgresql.insert(table)

    def for_update(self, query: sa.Select[Any]) -> sa.Select[Any]:
        return query.with_for_update()

    def json_array_holds(self, column: Any, value: str, path: str | None = None) -> Any:
        array: Any = sa.cast(column, JSONB)
        if path is not None:
            array = array[path.removeprefix("$.")]
        return array.has_key(value)

    def epoch_seconds(self, column: Any) -> Any:
        return sa.cast(sa.func.floor(sa.extract("epoch", column)), sa.BigInteger)

    def now(self) -> Any:
        return utcnow()


class SqliteDialect(SqlDialect):
    name = "sqlite"

    def insert(self, table: sa.Table) -> Any:
        return sqlite.insert(table)

    def for_update(self, query: sa.Select[Any]) -> sa.Select[Any]:
        # No row locks: every write transaction already holds the database's write lock
        # (``BEGIN IMMEDIATE``), taken before its first read.
        return query

    def json_array_holds(self, column: Any, value: str, path: str | None = None) -> Any:
        args = (column,) if path is None else (column, path)
        elements = sa.func.json_each(*args).table_valued("value").alias("element")
        return sa.exists().select_from(elements).where(elements.c.value == value)

    def epoch_seconds(self, column: Any) -> Any:
        # SQLite stores UTC datetimes as text; strftime('%s') reads them as UTC seconds.
        return sa.cast(sa.func.strftime(sa.literal_column("'%s'"), column), sa.BigInteger)

    def now(self) -> Any:
        return ingest.sqlite_now()


_DIALECTS: dict[str, SqlDialect] = {d.name: d for d in (PostgresDialect(), SqliteDialect())}


def sql_dialect(name: str) -> SqlDialect:
    """The pieces for a SQLAlchemy dialect name (``engine.dialect.name``)."""
    try:
        return _DIALECTS[name]
    except KeyError:
        raise ValueError(
            f"no ledger SQL for dialect {name!r}; the ledger runs on sqlite or postgresql"
        ) from None
