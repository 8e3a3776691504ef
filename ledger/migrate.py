"""Programmatic Alembic: ``upgrade``/``downgrade``/``current`` against a database URL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import pool

from ledger.engine import make_engine

_ROOT = Path(__file__).resolve().parent.parent


def alembic_config(url: str) -> Config:
    ini = _ROOT / "alembic.ini"
    cfg = Config(str(ini)) if ini.exists() else Config()
    import migrations

    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.attributes["db_url"] = url
    return cfg


def _off_loop(fn: Callable[[], None]) -> None:
    """Alembic's env runs its own event loop: from inside a running loop, use a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        fn()
        return
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run, name="rollout-ledger-migrate")
    worker.start()
    worker.join()
    if errors:
        raise errors[0]


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate to ``revision``; safe to run from several processes at once."""
    _off_loop(lambda: command.upgrade(alembic_config(url), revision))


def downgrade(url: str, revision: str) -> None:
    _off_loop(lambda: command.downgrade(alembic_config(url), revision))


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite:///unused.db")).get_current_head()


async def current_revision(url: str) -> str | None:
    engine = make_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(
                lambda c: MigrationContext.configure(c).get_current_revision()
            )
    finally:
        await engine.dispose()
