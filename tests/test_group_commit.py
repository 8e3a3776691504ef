"""The SQLite group-commit writer (issue 12): batches without per-write savepoints, commits
flushed behind the writer.  SQLite only: Postgres has no group-commit writer (one transaction
per write, the server groups its WAL flushes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ledger import migrate
from ledger.errors import NotFound
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
