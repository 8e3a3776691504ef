"""Postgres's optimistic record: reads without the rollout's lock, then one guarded write.

The write commits only if the rollout is still open at the version and creation time the
reads saw; otherwise it writes nothing and the record runs again under the lock.  These tests
put a change between the reads and the write, on a real Postgres."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa

from ledger.errors import RolloutFrozen
from ledger.records import coerce_entry
from ledger.storage import ingest
from ledger.storage.statements import STATEMENTS
from ledger.store import Ledger
from tests.conftest import migrated_postgres, require_postgres
from tests.test_lineage import capture_sql
from tests.test_promises import rec

pytestmark = pytest.mark.postgres

SYS = list(range(200, 240))


@pytest.fixture
async def pg() -> AsyncIterator[tuple[Ledger, asyncpg.Connection]]:
    url = migrated_postgres()
    led = Ledger(url)
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        yield led, conn
    finally:
        await conn.close()
        await led.close()


@pytest.fixture
def db_url_pg() -> str:
    return migrated_postgres()


def _steps(led: Ledger, record: dict[str, Any]) -> ingest.Steps:
    prep = ingest.prepare(coerce_entry(record), led._tips)
    return ingest.put_steps(
        prep,
        route=None,
        request_fingerprint="",
        continuation_fingerprint="",
        delta_records=led.delta_records,
        now=led._now(),
        optimistic=True,
    )


async def _reads(conn: asyncpg.Connection, steps: ingest.Steps) -> tuple[str, tuple[Any, ...]]:
    """Run the optimistic record's reads; returns its write, not yet sent."""
    step = next(steps)
    while not step[0].endswith("_if"):
        assert step[0] in {"rollout_and_call", "parent_candidates", "generation_of"}, step[0]
        step = steps.send(await conn.fetch(STATEMENTS[step[0]].postgresql, *step[1]))
    return step


async def _write(conn: asyncpg.Connection, steps: ingest.Steps, step: Any) -> Any:
    rows = await conn.fetch(STATEMENTS[step[0]].postgresql, *step[1])
    try:
        steps.send(rows)
    except StopIteration as done:
        return done.value
    raise AssertionError("the record's steps went on after its write")


async def _status(led: Ledger, rollout_id: str, call_id: str) -> list[str]:
    async with led.engine.connect() as conn:
        q = sa.text("SELECT status FROM calls WHERE rollout_id = :r AND model_call_id = :c")
        return [str(s) for s in (await conn.execute(q, {"r": rollout_id, "c": call_id})).scalars()]


async def test_a_record_over_its_intent_is_one_read_and_one_write(
    pg: tuple[Ledger, asyncpg.Connection], rid: Callable[[str], str]
) -> None:
    led, _ = pg
    r = rid("opt")
    await led.put(rec(r, "a", SYS, [1, 2]))
    await led.begin_call(r, "b")
    with capture_sql(led) as seen:
        res = await led.put(rec(r, "b", [*SYS, 1, 2, 7], [3]))
    assert res.status == "created" and res.parent_call_id == "a"
    # The rollout's state with the call, the parent candidates, then the one guarded write:
    # no lock of its own, no transaction around them.
    assert [s.split()[0] for s in seen] == ["SELECT", "SELECT", "WITH"], seen
    assert seen[0].startswith("SELECT r.state, r.version")
    assert "cumulative_len <=" in seen[1]
    assert seen[2].startswith("WITH r AS") and "FOR UPDATE" in seen[2]


async def test_a_longer_parent_written_between_reads_and_write_is_found_under_the_lock(
    pg: tuple[Ledger, asyncpg.Connection], rid: Callable[[str], str]
) -> None:
    led, conn = pg
    r = rid("race")
    await led.put(rec(r, "a", SYS, [1, 2]))
    await led.begin_call(r, "b")
    b = rec(r, "b", [*SYS, 1, 2, 7, 3, 4, 8], [5])
    steps = _steps(led, b)
    write = await _reads(conn, steps)
    assert write[0] == "record_over_intent_if"
    # Another writer records x, a longer prefix of b's prompt, before b's write.
    await led.put(rec(r, "x", [*SYS, 1, 2, 7], [3, 4]))
    assert await _write(conn, steps, write) is ingest.NEED_LOCK
    assert await _status(led, r, "b") == ["intent"]  # nothing written
    res = await led.put(b)
    assert res.status == "created" and res.parent_call_id == "x"
    views = {v.model_call_id: v for v in (await led.freeze_views(r)).calls}
    assert views["b"].parent_call_id == "x" and views["b"].shared_len == len(SYS) + 5


async def test_a_freeze_between_reads_and_write_refuses_the_record(
    pg: tuple[Ledger, asyncpg.Connection], rid: Callable[[str], str]
) -> None:
    led, conn = pg
    r = rid("frz")
    await led.put(rec(r, "a", SYS, [1, 2]))
    steps = _steps(led, rec(r, "late", [*SYS, 1, 2, 9], [3]))
    write = await _reads(conn, steps)
    assert write[0] == "record_insert_if"
    await led.freeze(r)
    assert await _write(conn, steps, write) is ingest.NEED_LOCK
    assert await _status(led, r, "late") == []
    with pytest.raises(RolloutFrozen):
        await led.put(rec(r, "late", [*SYS, 1, 2, 9], [3]))


async def test_an_intent_registered_between_reads_and_write_is_recorded_over(
    pg: tuple[Ledger, asyncpg.Connection], rid: Callable[[str], str]
) -> None:
    led, conn = pg
    r = rid("int")
    await led.put(rec(r, "a", SYS, [1, 2]))
    b = rec(r, "b", [*SYS, 1, 2, 7], [3])
    steps = _steps(led, b)
    write = await _reads(conn, steps)
    assert write[0] == "record_insert_if"
    # An intent does not bump the version: the insert meets its row and writes nothing.
    assert await led.begin_call(r, "b")
    assert await _write(conn, steps, write) is ingest.NEED_LOCK
    assert await _status(led, r, "b") == ["intent"]
    res = await led.put(b)
    assert res.status == "created" and res.parent_call_id == "a"
    assert await _status(led, r, "b") == ["captured"]


async def test_a_repeat_and_a_conflict_run_under_the_lock(
    pg: tuple[Ledger, asyncpg.Connection], rid: Callable[[str], str]
) -> None:
    led, conn = pg
    r = rid("rep")
    a = rec(r, "a", SYS, [1, 2])
    await led.put(a)
    # The reads see the call captured: the optimistic form hands over without a write.
    steps = _steps(led, a)
    first = next(steps)
    assert first[0] == "rollout_and_call"
    with pytest.raises(StopIteration) as done:
        steps.send(await conn.fetch(STATEMENTS[first[0]].postgresql, *first[1]))
    assert done.value.value is ingest.NEED_LOCK
    assert (await led.put(a)).status == "duplicate"


async def test_a_guarded_write_waits_for_the_lock_and_sees_the_holders_commit(
    pg: tuple[Ledger, asyncpg.Connection], rid: Callable[[str], str]
) -> None:
    """A writer holding the rollout's lock commits a bump while the guarded write waits on it:
    the write re-reads the row after the wait, sees the new version, and writes nothing."""
    led, conn = pg
    r = rid("wait")
    await led.put(rec(r, "a", SYS, [1, 2]))
    await led.begin_call(r, "b")
    steps = _steps(led, rec(r, "b", [*SYS, 1, 2, 7], [3]))
    write = await _reads(conn, steps)
    url = require_postgres().replace("postgresql+asyncpg://", "postgresql://")
    holder = await asyncpg.connect(url)
    try:
        tx = holder.transaction()
        await tx.start()
        await holder.execute("SELECT 1 FROM rollouts WHERE rollout_id = $1 FOR UPDATE", r)
        pending = asyncio.ensure_future(_write(conn, steps, write))
        await asyncio.sleep(0.2)
        assert not pending.done()  # waiting on the lock
        await holder.execute("UPDATE rollouts SET version = version + 1 WHERE rollout_id = $1", r)
        await tx.commit()
        assert await pending is ingest.NEED_LOCK
    finally:
        await holder.close()
    assert await _status(led, r, "b") == ["intent"]


async def test_a_continuation_of_this_ledgers_own_write_is_one_statement(
    pg: tuple[Ledger, asyncpg.Connection], rid: Callable[[str], str]
) -> None:
    """After a guarded write the ledger knows the rollout's head: the next record of the
    rollout, naming (as NeMo Gym stamps it) the parent this ledger wrote, is its write alone;
    one proven by tokens reads only its parent candidates."""
    led, _ = pg
    r = rid("head")
    await led.put(rec(r, "a", SYS, [1, 2]))  # a new rollout: under the lock
    await led.begin_call(r, "b")
    await led.put(rec(r, "b", [*SYS, 1, 2, 7], [3]))  # reads, then the guarded write
    await led.begin_call(r, "c")
    c = rec(r, "c", [*SYS, 1, 2, 7, 3, 8], [4], parent_call_id="b", parent_resolution="resolved")
    with capture_sql(led) as seen:
        res = await led.put(c)
    assert res.status == "created" and res.parent_call_id == "b"
    assert len(seen) == 1 and seen[0].startswith("WITH r AS"), seen
    await led.begin_call(r, "d")
    with capture_sql(led) as seen:
        res = await led.put(rec(r, "d", [*SYS, 1, 2, 7, 3, 8, 4, 9], [5]))
    assert res.parent_call_id == "c" and res.edge_method == "token_prefix"
    assert [s.split()[0] for s in seen] == ["SELECT", "WITH"], seen
    assert "cumulative_len <=" in seen[0]
    views = {v.model_call_id: v for v in (await led.freeze_views(r)).calls}
    assert [views[k].parent_call_id for k in "abcd"] == [None, "a", "b", "c"]


async def test_a_stale_head_costs_one_write_then_the_reads(
    pg: tuple[Ledger, asyncpg.Connection], db_url_pg: str, rid: Callable[[str], str]
) -> None:
    """Another writer (another process) records into the rollout: this ledger's remembered
    head is stale, its guarded write finds so and writes nothing, and the record is decided
    again on fresh reads, with the other writer's call as its parent."""
    led, _ = pg
    r = rid("stale")
    await led.put(rec(r, "a", SYS, [1, 2]))
    await led.put(rec(r, "b", [*SYS, 1, 2, 7], [3]))
    other = Ledger(db_url_pg)
    try:
        await other.put(rec(r, "x", [*SYS, 1, 2, 7, 3, 8], [4]))
    finally:
        await other.close()
    with capture_sql(led) as seen:
        res = await led.put(rec(r, "c", [*SYS, 1, 2, 7, 3, 8, 4, 9], [5]))
    assert res.status == "created" and res.parent_call_id == "x"
    writes = [i for i, s in enumerate(seen) if s.startswith("WITH r AS")]
    reads = [i for i, s in enumerate(seen) if s.startswith("SELECT r.state")]
    # The remembered head's write (refused by its guard), then the reads and the write again.
    assert len(writes) == 2 and len(reads) == 1 and writes[0] < reads[0] < writes[1], seen
    assert await _status(led, r, "c") == ["captured"]
