"""Driver errors are translated by constraint name (issue 9), on SQLite and Postgres."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ledger.errors import InvalidInput, Unavailable
from ledger.storage.queries import deliveries
from ledger.storage.translate import REFUSED_BY, _translate_error, constraint_name
from ledger.store import Ledger
from ledger.tables import Base

Rid = Callable[[str], str]


def test_every_constraint_of_the_schema_has_a_decision() -> None:
    declared = {
        str(c.name)
        for table in Base.metadata.sorted_tables
        for c in table.constraints
        if isinstance(c, sa.CheckConstraint | sa.UniqueConstraint)
    }
    assert declared == set(REFUSED_BY)


def test_constraint_name_reads_sqlite_messages() -> None:
    assert constraint_name(Exception("CHECK constraint failed: ck_calls_status")) == (
        "ck_calls_status"
    )
    unique = Exception("UNIQUE constraint failed: calls.rollout_id, calls.model_call_id")
    assert constraint_name(unique) == "uq_calls_rollout_id_model_call_id"
    assert constraint_name(Exception("NOT NULL constraint failed: calls.model")) is None


def test_raw_sqlite_errors_of_the_group_commit_writer_are_translated() -> None:
    """The writer runs its own ``BEGIN IMMEDIATE`` on the raw ``sqlite3`` connection: a lock
    it cannot get is the database being unavailable (the proxy answers 503), a violated
    constraint is a refusal by name, anything else stays what it is (a bug is not hidden)."""
    locked = _translate_error(sqlite3.OperationalError("database is locked"))
    assert isinstance(locked, Unavailable)
    unique = sqlite3.IntegrityError(
        "UNIQUE constraint failed: calls.rollout_id, calls.model_call_id"
    )
    refused = _translate_error(unique)
    assert isinstance(refused, InvalidInput)
    misuse = sqlite3.ProgrammingError("Cannot operate on a closed database.")
    assert _translate_error(misuse) is misuse


async def test_a_check_violation_is_named(ledger: Ledger, rid: Rid) -> None:
    r = rid("check")
    with pytest.raises(InvalidInput, match="ck_deliveries_outcome"):
        await ledger.record_delivery(
            r,
            snapshot_id=None,
            version=None,
            outcome="nonsense",
            mask_reasons=[],
            metrics={},
            terminal=None,
        )


async def test_a_unique_violation_is_named_and_changes_nothing(ledger: Ledger, rid: Rid) -> None:
    r, key = rid("unique"), rid("key")

    def twice(conn: Connection) -> None:
        ledger._lock_rollout(conn, r)
        for _ in range(2):
            conn.execute(
                deliveries.insert().values(
                    rollout_id=r, outcome="masked", metrics={}, idempotency_key=key
                )
            )

    with pytest.raises(InvalidInput, match="uq_deliveries_idempotency_key"):
        await ledger._transact(twice)
    async with ledger._read() as conn:
        query = sa.select(deliveries.c.id).where(deliveries.c.rollout_id == r)
        rows = (await conn.execute(query)).all()
    assert rows == []
