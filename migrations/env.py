"""Alembic environment: async engines for SQLite and Postgres, guarded against concurrent runs.

Two processes running ``db upgrade`` at once serialise on a lock taken in the migration
transaction before Alembic reads the current revision: ``pg_advisory_xact_lock`` on Postgres,
``BEGIN IMMEDIATE`` (the engine's write transactions) on SQLite.  The second run then finds the
schema at head and does nothing.
"""

from __future__ import annotations

import asyncio
import os

import sqlalchemy as sa
from alembic import context
from sqlalchemy.engine import Connection

from ledger.engine import DEFAULT_DB_URL, make_engine
from ledger.tables import Base

MIGRATION_LOCK_KEY = 0x726F6C6C  # "roll": one advisory lock id for every ledger database

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return str(
        config.attributes.get("db_url")
        or os.environ.get("ROLLOUT_LEDGER_DB")
        or config.get_main_option("sqlalchemy.url")
        or DEFAULT_DB_URL
    )


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        transaction_per_migration=False,
    )


def _run_sync(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(
                sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY}
            )
        context.run_migrations()


async def _run_async() -> None:
    engine = make_engine(_url(), poolclass=sa.pool.NullPool)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_run_sync)
    finally:
        await engine.dispose()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_sync(connection)
    else:
        asyncio.run(_run_async())
