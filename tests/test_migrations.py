"""Issue #2 point 2: migrations are code with tests, on SQLite and Postgres.

Every test starts from a fresh, empty database: a new SQLite file, or a new Postgres database
created for the test (through ``ROLLOUT_LEDGER_TEST_PG_ADMIN_URL``, or the test server's
``postgres`` database) and dropped afterwards.  Alembic's environment runs its own event loop,
so Alembic commands run in a worker thread.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, make_url

from ledger import custody, migrate
from ledger.engine import make_engine
from ledger.model import Quarantine
from ledger.store import Ledger
from ledger.tables import Base
from tests.conftest import pg_async_url, require_postgres

Rid = Callable[[str], str]
ROOT = Path(__file__).resolve().parent.parent
CLI_TIMEOUT_S = 60
TABLES = set(Base.metadata.tables) | {"alembic_version"}


# --------------------------------------------------------------------------- fresh databases


def _admin_url(test_url: str) -> URL:
    explicit = os.environ.get("ROLLOUT_LEDGER_TEST_PG_ADMIN_URL")
    return (
        make_url(pg_async_url(explicit))
        if explicit
        else make_url(test_url).set(database="postgres")
    )


def _admin_execute(admin: URL, sql: str) -> None:
    """Run one statement on the admin database (CREATE/DROP DATABASE cannot be in a transaction).

    In a thread of its own, so it works whether or not the caller has an event loop running.
    """

    async def run() -> None:
        dsn = admin.set(drivername="postgresql").render_as_string(hide_password=False)
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result(timeout=60)


@pytest.fixture
def fresh_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """An empty database that exists only for this test."""
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'fresh.db'}"
        return
    test_url = require_postgres()
    admin = _admin_url(test_url)
    name = f"rl_migtest_{uuid.uuid4().hex[:12]}"
    _admin_execute(admin, f'CREATE DATABASE "{name}"')
    try:
        yield make_url(test_url).set(database=name).render_as_string(hide_password=False)
    finally:
        _admin_execute(admin, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def open_ledgers() -> AsyncIterator[list[Ledger]]:
    """Ledgers a test opens, closed even when it fails (so a fresh database can be dropped)."""
    ledgers: list[Ledger] = []
    yield ledgers
    for led in ledgers:
        await led.close()


async def inspect(url: str, fn: Callable[[sa.Inspector], Any]) -> Any:
    engine = make_engine(url, poolclass=sa.pool.NullPool)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda c: fn(sa.inspect(c)))
    finally:
        await engine.dispose()


async def row_counts(url: str) -> dict[str, int]:
    """Rows per model table, for the tables that exist at the database's revision."""
    engine = make_engine(url, poolclass=sa.pool.NullPool)
    try:
        async with engine.connect() as conn:
            existing = set(await conn.run_sync(lambda c: sa.inspect(c).get_table_names()))
            return {
                t: (await conn.execute(sa.text(f"SELECT count(*) FROM {t}"))).scalar_one()
                for t in sorted(TABLES & existing)
            }
    finally:
        await engine.dispose()


def revision_chain() -> list[str]:
    """Every revision, head first, down to the first one (the history is linear)."""
    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite:///unused.db"))
    out: list[str] = []
    rev = script.get_current_head()
    while rev is not None:
        out.append(rev)
        revision = script.get_revision(rev)
        assert revision is not None
        down = revision.down_revision
        assert not isinstance(down, tuple | list), f"revision {rev} merges branches"
        rev = down
    return out


# --------------------------------------------------------------------------- 1. upgrade


async def test_upgrade_from_empty_reaches_head_with_every_table(fresh_url: str) -> None:
    """An empty database upgrades to ``head_revision()`` with every model table, idempotently."""
    assert await migrate.current_revision(fresh_url) is None
    await asyncio.to_thread(migrate.upgrade, fresh_url)
    assert migrate.head_revision() is not None
    assert await migrate.current_revision(fresh_url) == migrate.head_revision()
    assert set(await inspect(fresh_url, lambda i: i.get_table_names())) == TABLES
    # Constraint names come from the naming convention, identical on both dialects.
    uniques = await inspect(fresh_url, lambda i: i.get_unique_constraints("calls"))
    assert "uq_calls_rollout_id_model_call_id" in {u["name"] for u in uniques}
    # Upgrading again is a no-op.
    await asyncio.to_thread(migrate.upgrade, fresh_url)
    assert await migrate.current_revision(fresh_url) == migrate.head_revision()


# --------------------------------------------------------------------------- 2. no drift


async def test_alembic_check_finds_no_drift_between_models_and_migrations(fresh_url: str) -> None:
    """Replaying every migration yields exactly the schema ``ledger.tables`` declares."""
    await asyncio.to_thread(migrate.upgrade, fresh_url)
    # Raises AutogenerateDiffsDetected, listing the differences, if the two disagree.
    await asyncio.to_thread(command.check, migrate.alembic_config(fresh_url))


def _declared_constraints() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for table in Base.metadata.sorted_tables:
        out[table.name] = {
            "check": sorted(
                str(c.name) for c in table.constraints if isinstance(c, sa.CheckConstraint)
            ),
            "unique": sorted(
                str(c.name) for c in table.constraints if isinstance(c, sa.UniqueConstraint)
            ),
            "fk": sorted(
                (str(fk.name), fk.referred_table.name, (fk.ondelete or "").upper())
                for fk in table.foreign_key_constraints
            ),
        }
    return out


def _reflected_constraints(i: sa.Inspector) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in Base.metadata.tables:
        out[name] = {
            "check": sorted(str(c["name"]) for c in i.get_check_constraints(name)),
            "unique": sorted(str(c["name"]) for c in i.get_unique_constraints(name)),
            "fk": sorted(
                (
                    str(fk["name"]),
                    fk["referred_table"],
                    str(fk.get("options", {}).get("ondelete") or "").upper(),
                )
                for fk in i.get_foreign_keys(name)
            ),
        }
    return out


async def test_migrated_schema_has_every_named_constraint(fresh_url: str) -> None:
    """What ``alembic check`` does not compare: CHECK constraints, and foreign keys' ON DELETE.

    The storage layer relies on both (states are enforced by CHECKs; deleting a rollout cascades),
    so the migrated schema must carry each one under the name the naming convention gives it.
    """
    await asyncio.to_thread(migrate.upgrade, fresh_url)
    assert await inspect(fresh_url, _reflected_constraints) == _declared_constraints()


def _index_definitions(i: sa.Inspector) -> tuple[str, dict[str, str]]:
    """The dialect's name and each index's definition as the database states it."""
    dialect = i.dialect.name
    sql = (
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
        if dialect == "sqlite"
        else "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
    )
    assert isinstance(i.bind, sa.Connection)
    return dialect, {str(n): str(d) for n, d in i.bind.execute(sa.text(sql)).all()}


async def test_migrated_indexes_keep_their_partial_conditions(fresh_url: str) -> None:
    """Nor does ``alembic check`` compare a partial index's condition.  The calls' lineage and
    continuation indexes leave intents out (``status = 'captured'``: migration 0005), and the
    hot path's statements name that status literally to use them; every index the models
    declare with a condition has it in the migrated schema, and no other index has one."""
    await asyncio.to_thread(migrate.upgrade, fresh_url)
    dialect, defs = await inspect(fresh_url, _index_definitions)
    declared = {
        str(index.name): index.dialect_kwargs.get(f"{dialect}_where")
        for table in Base.metadata.sorted_tables
        for index in table.indexes
    }
    assert {n for n, w in declared.items() if w is not None} == {
        "ix_calls_rollout_id_cumulative_len",
        "ix_calls_rollout_id_continuation_fingerprint",
    }
    for name, where in declared.items():
        definition = defs[name]
        assert (" WHERE " in definition.upper()) == (where is not None), (name, definition)
        for literal in re.findall(r"'[^']*'", "" if where is None else str(where)):
            assert literal in definition, (name, definition)


# --------------------------------------------------------------------------- 3. round trip


def _rec(rollout_id: str, call_id: str, prompt: list[int], gen: list[int]) -> dict[str, Any]:
    return {
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "model": "policy-v1",
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-(i + 1) / 7 for i in range(len(gen))],
        "created_at": 1_700_000_000.5,
        "output_items": [{"type": "message", "role": "assistant", "content": []}],
        "token_item_index": 0,
        "response_id": f"resp-{call_id}",
        "sampling": {"temperature": 0.7},
    }


async def test_downgrade_then_upgrade_keeps_rows(
    fresh_url: str, rid: Rid, open_ledgers: list[Ledger]
) -> None:
    """Each round trip, head to every earlier revision and back, keeps every row.

    The rows come from the Ledger API: a frozen rollout with a token-prefix chain (delta records,
    lineage edges), a delivery with a quarantine, an open rollout with an intent and an
    incomplete mark.  After each round trip the frozen snapshot is identical and the open
    rollout still takes records.
    """
    await asyncio.to_thread(migrate.upgrade, fresh_url)
    led = Ledger(fresh_url)
    open_ledgers.append(led)
    done, live = rid("mig-done"), rid("mig-live")
    await led.put(_rec(done, "c1", [1, 2, 3], [4, 5]))
    await led.put(_rec(done, "c2", [1, 2, 3, 4, 5, 6], [7, 8]))
    await led.put(_rec(done, "c3", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10]))
    before = await led.freeze(done)
    await led.record_delivery(
        done,
        snapshot_id=before.snapshot_id,
        version=before.version,
        outcome="masked",
        mask_reasons=["unresolved_retry"],
        metrics={"n_calls": 3},
        terminal=None,
        quarantines=[Quarantine("c3", "retry_not_kept", "kept for the test")],
    )
    await led.begin_call(live, "c1")
    await led.put(_rec(live, "c1", [11, 12], [13]))
    await led.begin_call(live, "c2")
    await led.mark_incomplete(live, "c9", reason="upstream_error", detail="kept for the test")
    await custody.record_failure(led, live, "c7", "worker_capture_failed")  # a CaptureLedger row
    await led.close()
    open_ledgers.remove(led)
    counts = await row_counts(fresh_url)
    assert all(counts[t] > 0 for t in TABLES), counts

    head = migrate.head_revision()
    for target in revision_chain()[1:]:
        await asyncio.to_thread(migrate.downgrade, fresh_url, target)
        assert await migrate.current_revision(fresh_url) == target
        kept = await row_counts(fresh_url)
        assert kept == {t: counts[t] for t in kept}, f"rows changed at revision {target}"
        await asyncio.to_thread(migrate.upgrade, fresh_url)
        assert await migrate.current_revision(fresh_url) == head
        # Tables created after ``target`` come back empty; every other row is still there.
        counts = {t: counts[t] if t in kept else 0 for t in counts}
        assert await row_counts(fresh_url) == counts

    led = Ledger(fresh_url)
    open_ledgers.append(led)
    after = await led.freeze(done)
    assert (after.snapshot_id, after.version, after.incomplete) == (
        before.snapshot_id,
        before.version,
        before.incomplete,
    )
    assert [e.model_dump_json() for e in after.entries] == [
        e.model_dump_json() for e in before.entries
    ]
    views = await led.freeze_views(done)
    assert [(c.model_call_id, c.parent_call_id) for c in views.calls] == [
        ("c1", None),
        ("c2", "c1"),
        ("c3", "c2"),
    ]
    assert (await led.put(_rec(live, "c2", [11, 12, 13, 14], [15]))).status == "created"
    snap = await led.freeze(live)
    assert [e.model_call_id for e in snap.entries] == ["c1", "c2"] and snap.incomplete


def test_revision_history_is_linear_and_reaches_head() -> None:
    """Backend-independent: one linear history from a single base to the one head."""
    chain = revision_chain()
    assert chain[0] == migrate.head_revision() and len(chain) == len(set(chain))


# --------------------------------------------------------------------------- 4. concurrent CLI


def _cli() -> str:
    exe = Path(sys.executable).with_name("rollout-ledger")
    assert exe.is_file(), f"console script not installed next to {sys.executable}"
    return str(exe)


@pytest.mark.parametrize("attempt", range(3))
def test_two_processes_upgrading_at_once_both_succeed_once(fresh_url: str, attempt: int) -> None:
    """``rollout-ledger db upgrade`` twice at the same moment on an empty database.

    Both processes are started before either is waited on; both exit 0, the schema is at head,
    and ``alembic_version`` holds exactly one row.  Start-up jitter (imports) sometimes lets one
    finish before the other begins migrating, so three attempts, each on a fresh database, make
    a real overlap very likely.  (A plain test: no event loop is needed while they run.)
    """
    cmd = [_cli(), "db", "upgrade", "--db", fresh_url]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    try:
        results: list[tuple[int, str, str]] = []
        for p in procs:
            out, err = p.communicate(timeout=CLI_TIMEOUT_S)
            results.append((p.returncode, out.decode(), err.decode()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rc, stdout, stderr in results:
        assert rc == 0, f"db upgrade exited {rc}:\n{stdout}\n{stderr}"
        assert f"schema at revision {migrate.head_revision()}" in stderr
    assert asyncio.run(migrate.current_revision(fresh_url)) == migrate.head_revision()
    counts = asyncio.run(row_counts(fresh_url))
    assert counts["alembic_version"] == 1
    assert set(asyncio.run(inspect(fresh_url, lambda i: i.get_table_names()))) == TABLES
