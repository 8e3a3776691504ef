"""``/healthz``: database reachable and schema at head, cheaply (issue 13, point 2).

The check runs on the ledger's pooled engine (never a new engine per request), the schema head
is read from the migration scripts once per process (off the event loop), and concurrent probes
share one database round trip: while a check is in flight, later probes await its answer.  A
burst of probes therefore costs one pooled connection, not one connection each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Connection

from ledger import migrate
from ledger.redact import redact_text, redact_url
from ledger.store import Ledger

__all__ = ["HealthCheck"]


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    body: dict[str, Any]


def _revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


class HealthCheck:
    """One per application; ``await check()`` gives ``(status_code, body)``."""

    def __init__(self, ledger: Callable[[], Ledger], upstream: str | None) -> None:
        self._ledger = ledger
        self._upstream = redact_url(upstream)
        self._head: str | None = None
        self._head_known = False
        self._inflight: asyncio.Future[_Answer] | None = None
        self.db_checks = 0  # how many database round trips were made (for tests and metrics)

    async def check(self) -> tuple[int, dict[str, Any]]:
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._run())
            self._inflight.add_done_callback(self._clear)
        answer = await asyncio.shield(self._inflight)
        return answer.status, answer.body

    def _clear(self, _fut: asyncio.Future[_Answer]) -> None:
        self._inflight = None

    async def _head_revision(self) -> str | None:
        if not self._head_known:
            # Reads the migration scripts from disk: once, in a thread.
            self._head = await asyncio.to_thread(migrate.head_revision)
            self._head_known = True
        return self._head

    async def _run(self) -> _Answer:
        head = await self._head_revision()
        self.db_checks += 1
        body: dict[str, Any]
        try:
            async with self._ledger().engine.connect() as conn:
                current = await conn.run_sync(_revision)
        except Exception as exc:
            body = {
                "status": "unavailable",
                "database": f"unreachable: {type(exc).__name__}",
                "detail": redact_text(str(exc).split("\n", 1)[0])[:300],
            }
            answer = _Answer(503, body)
        else:
            ok = current == head
            body = {
                "status": "ok" if ok else "schema_behind",
                "database": "ok",
                "schema": current,
                "head": head,
                "upstream": self._upstream,
            }
            answer = _Answer(200 if ok else 503, body)
        return answer
