"""Throwaway databases for one benchmark run: SQLite files in a temp dir, Postgres ``rl_bench_*``.

Every database is created fresh, migrated to head, and removed when the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledger import migrate

__all__ = ["Db", "DbFactory", "pg_admin_url"]

PG_ADMIN = os.environ.get(
    "ROLLOUT_LEDGER_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres"
)
LEDGER_TABLES = (
    "rollouts",
    "calls",
    "call_tokens",
    "lineage_edges",
    "quarantines",
    "incomplete_events",
    "deliveries",
)


def pg_admin_url() -> str:
    return PG_ADMIN


# Bytes of the heap and TOAST pages of the ledger's tables that were never initialised
# (``Db.size_bytes``): all-zero pages that a bulk extension added ahead of need.
_UNUSED_PAGE_BYTES = """
SELECT current_setting('block_size')::bigint * count(*)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
CROSS JOIN unnest(ARRAY[c.oid, c.reltoastrelid]) AS r(oid)
CROSS JOIN generate_series(
    0, pg_relation_size(r.oid) / current_setting('block_size')::bigint - 1) AS b
WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname = ANY($1::text[])
  AND r.oid <> 0
  AND (page_header(get_raw_page(r.oid::regclass::text, 'main', b))).upper = 0
"""


@dataclass
class Db:
    backend: str  # sqlite | postgres
    url: str
    path: Path | None = None  # the SQLite file
    name: str = ""  # the Postgres database
    # Postgres: whether the last ``size_bytes`` left out pages added ahead of need.
    unused_pages_counted: bool | None = None

    async def size_bytes(self) -> int:
        """On-disk size: SQLite file after a TRUNCATE checkpoint (main db, WAL folded in);
        Postgres: ``pg_total_relation_size`` summed over the ledger's tables (heap, TOAST,
        indexes), less the pages Postgres added ahead of need that nothing has used yet.

        When several backends wait to extend the same table, Postgres adds pages for all of
        them at once (20 per waiter in Postgres 15, up to 512) and leaves them all-zero in the
        free-space map until an insert takes one. A size read at a given moment counts them as
        stored although they hold nothing: at 8x50 they were 0-1.5 MB of a run's 2.6 MB here,
        so a difference of two sizes swung from 0.37x to 1.52x raw between repetitions. Such
        pages are found with ``pageinspect`` (a page never initialised has ``upper = 0``); where
        the extension cannot be created (not a superuser) the plain size is returned and
        :attr:`unused_pages_counted` is False."""
        if self.backend == "sqlite":
            assert self.path is not None
            await self.checkpoint()
            wal = self.path.with_name(self.path.name + "-wal")
            return self.path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
        import asyncpg

        conn = await asyncpg.connect(self.pg_dsn)
        try:
            total = await conn.fetchval(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname = ANY($1::text[])",
                list(LEDGER_TABLES),
            )
            try:
                await conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
                unused = await conn.fetchval(_UNUSED_PAGE_BYTES, list(LEDGER_TABLES))
            except asyncpg.PostgresError:  # not a superuser (the extension's functions need one)
                self.unused_pages_counted = False
                return int(total)
            self.unused_pages_counted = True
            return int(total) - int(unused)
        finally:
            await conn.close()

    async def table_sizes(self) -> dict[str, int]:
        """On-disk bytes per object.  SQLite: ``dbstat`` pages per table and per index (when
        the library has dbstat).  Postgres: per ledger table, heap / TOAST / indexes apart."""
        if self.backend == "sqlite":
            try:
                rows = await self.query("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")
            except Exception:
                return {}
            return {str(n): int(b) for n, b in rows}
        rows = await self.query(
            "SELECT c.relname, pg_relation_size(c.oid), pg_indexes_size(c.oid), "
            "pg_total_relation_size(c.oid) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname = ANY($1::text[])",
            list(LEDGER_TABLES),
        )
        out: dict[str, int] = {}
        for name, heap, idx, total in rows:
            out[f"{name} (heap)"] = int(heap)
            out[f"{name} (indexes)"] = int(idx)
            out[f"{name} (toast+fsm+vm)"] = int(total) - int(heap) - int(idx)
        return out

    async def page_use(self) -> dict[str, dict[str, int]]:
        """SQLite only: per table/index, bytes of pages, of row payload, and unused."""
        if self.backend != "sqlite":
            return {}
        try:
            rows = await self.query(
                "SELECT name, sum(pgsize), sum(payload), sum(unused) FROM dbstat GROUP BY name"
            )
        except Exception:
            return {}
        return {
            str(n): {"bytes": int(b), "payload": int(p), "unused": int(u)} for n, b, p, u in rows
        }

    async def vacuum(self) -> None:
        """Postgres: plain ``VACUUM`` (what autovacuum would do: dead intent-row versions become
        reusable, empty trailing pages are truncated)."""
        if self.backend != "postgres":
            return
        import asyncpg

        conn = await asyncpg.connect(self.pg_dsn)
        try:
            await conn.execute("VACUUM")
        finally:
            await conn.close()

    async def pause_autovacuum(self) -> None:
        """Postgres: no autovacuum on the ledger's tables (nor their TOAST tables) from now on:
        relation sizes then grow with what is written, not also when the daemon first visits."""
        if self.backend != "postgres":
            return
        import asyncpg

        conn = await asyncpg.connect(self.pg_dsn)
        try:
            for table in LEDGER_TABLES:
                await conn.execute(
                    f"ALTER TABLE {table} SET (autovacuum_enabled = false, "
                    "toast.autovacuum_enabled = false)"
                )
        finally:
            await conn.close()

    async def checkpoint(self) -> None:
        if self.backend == "sqlite":
            await self.query("PRAGMA wal_checkpoint(TRUNCATE)")

    async def query(self, sql: str, *args: Any) -> list[Any]:
        """Run one statement outside the ledger's engine (no BEGIN IMMEDIATE around it).

        Placeholders: ``?`` on SQLite, ``$1`` on Postgres."""
        if self.backend == "sqlite":
            return await asyncio.to_thread(self._sqlite_query, sql, args)
        import asyncpg

        conn = await asyncpg.connect(self.pg_dsn)
        try:
            return [tuple(r) for r in await conn.fetch(sql, *args)]
        finally:
            await conn.close()

    def _sqlite_query(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        assert self.path is not None
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=60)
        try:
            return list(conn.execute(sql, args).fetchall())
        finally:
            conn.close()

    @property
    def pg_dsn(self) -> str:
        return PG_ADMIN.rsplit("/", 1)[0] + "/" + self.name


class DbFactory:
    """Creates fresh, migrated databases and drops them all on :meth:`cleanup`."""

    def __init__(self, workdir: Path | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="rl_bench_", dir=workdir))
        self.tag = uuid.uuid4().hex[:8]
        self._pg: list[str] = []
        self._n = 0

    async def pg_available(self) -> str | None:
        """None when Postgres answers, else why not."""
        import asyncpg

        try:
            conn = await asyncio.wait_for(asyncpg.connect(PG_ADMIN), 5)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        await conn.close()
        return None

    async def create(self, backend: str, label: str) -> Db:
        self._n += 1
        if backend == "sqlite":
            path = self.tmp / f"{label}-{self._n}.db"
            db = Db("sqlite", f"sqlite+aiosqlite:///{path}", path=path)
        else:
            import asyncpg

            name = f"rl_bench_{label}_{self.tag}_{self._n}"
            conn = await asyncpg.connect(PG_ADMIN)
            try:
                await conn.execute(f'CREATE DATABASE "{name}"')
            finally:
                await conn.close()
            self._pg.append(name)
            base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
            db = Db("postgres", f"{base}/{name}", name=name)
        await asyncio.to_thread(migrate.upgrade, db.url)
        return db

    async def drop(self, db: Db) -> None:
        if db.backend == "sqlite":
            assert db.path is not None
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(str(db.path) + suffix)
            return
        import asyncpg

        conn = await asyncpg.connect(PG_ADMIN)
        try:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
                db.name,
            )
            await conn.execute(f'DROP DATABASE IF EXISTS "{db.name}"')
        finally:
            await conn.close()
        if db.name in self._pg:
            self._pg.remove(db.name)

    async def cleanup(self) -> None:
        for name in list(self._pg):
            await self.drop(Db("postgres", "", name=name))
        for p in sorted(self.tmp.glob("*"), reverse=True):
            if p.is_file():
                p.unlink()
        with contextlib.suppress(OSError):
            self.tmp.rmdir()
