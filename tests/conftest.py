"""Shared fixtures: every storage test runs on a SQLite file and on Postgres.

Postgres comes from ``ROLLOUT_LEDGER_TEST_PG_URL`` (``scripts/test`` creates a fresh database
and exports it).  Without it the Postgres parameters skip, unless ``ROLLOUT_LEDGER_REQUIRE_PG=1``
(CI), where a skipped Postgres test fails the run.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from ledger import migrate
from ledger.store import Ledger

pytest_plugins = ["tests.proxy_support"]

PG_URL = os.environ.get("ROLLOUT_LEDGER_TEST_PG_URL", "")
REQUIRE_PG = os.environ.get("ROLLOUT_LEDGER_REQUIRE_PG") == "1"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def pg_async_url(url: str = PG_URL) -> str:
    if url.startswith("postgresql://"):
        return "postgresql+asyncpg://" + url[len("postgresql://") :]
    return url


def require_postgres() -> str:
    if not PG_URL:
        if REQUIRE_PG:
            pytest.fail("ROLLOUT_LEDGER_REQUIRE_PG=1 but ROLLOUT_LEDGER_TEST_PG_URL is not set")
        pytest.skip("no Postgres for this run (set ROLLOUT_LEDGER_TEST_PG_URL or use scripts/test)")
    return pg_async_url()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    # An opt-in test (run only when asked, e.g. the slow differential tier) may skip.
    opted_out = item.get_closest_marker("opt_in") is not None
    if (
        REQUIRE_PG
        and report.skipped
        and not opted_out
        and item.get_closest_marker("postgres") is not None
    ):
        report.outcome = "failed"
        report.longrepr = f"Postgres test skipped while Postgres is required: {report.longrepr}"


_pg_migrated = False


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def migrated_postgres() -> str:
    """The run's Postgres database, migrated to head (once per run)."""
    global _pg_migrated
    url = require_postgres()
    if not _pg_migrated:
        migrate.upgrade(url)
        _pg_migrated = True
    return url


@pytest.fixture
def db_url(backend: str, tmp_path: Path) -> str:
    """A migrated database: a fresh SQLite file, or the run's Postgres database."""
    if backend == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
        migrate.upgrade(url)
        return url
    return migrated_postgres()


@pytest.fixture
async def ledger(db_url: str) -> AsyncIterator[Ledger]:
    led = Ledger(db_url)
    yield led
    await led.close()


@pytest.fixture
def rid() -> Callable[[str], str]:
    """Unique rollout ids, so tests sharing the Postgres database never collide."""
    run = uuid.uuid4().hex[:8]

    def make(name: str = "r") -> str:
        return f"{name}-{run}-{uuid.uuid4().hex[:6]}"

    return make
