"""Is there a ledger at this URL?  Checked without creating or migrating anything.

Only ``rollout-ledger db upgrade`` and ``serve`` (by default) create or migrate a ledger.
Everything else (``audit``, ``sweep``, ``collect``, the Gym clients built from a database URL)
calls ``require_ledger`` first and refuses with ``NoLedger`` ("no ledger at …") otherwise: a
read-only command must never leave a new SQLite file or eight tables in a shared database.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import URL

from ledger.engine import normalize_url
from ledger.errors import NoLedger

__all__ = ["display_url", "known_revisions", "require_ledger", "sqlite_path"]


def display_url(url: str | URL) -> str:
    """The URL as a person should see it: the password hidden, a SQLite file as its path."""
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        return str(u.database)
    return u.render_as_string(hide_password=True)


def sqlite_path(url: str | URL) -> Path | None:
    """The file of a SQLite URL, or ``None`` for another backend."""
    u = normalize_url(url)
    return Path(str(u.database)) if u.get_backend_name() == "sqlite" else None


def _create_hint(url: str | URL) -> str:
    shown = normalize_url(url).render_as_string(hide_password=True)
    return (
        f"create it with `rollout-ledger db upgrade --db {shown}` "
        "(or start `rollout-ledger serve`, which creates it)"
    )


async def require_ledger(url: str) -> None:
    """Raise ``NoLedger`` unless ``url`` holds a ledger at this version's schema head.

    Reads only: a missing SQLite file is never created, a database without the ledger's
    tables is left as it is.
    """
    from ledger import migrate

    path = sqlite_path(url)
    if path is not None and not path.is_file():
        raise NoLedger(f"no ledger at {path}: {_create_hint(url)}")
    current = await migrate.current_revision(url)
    head = migrate.head_revision()
    if current is None:
        raise NoLedger(f"no ledger at {display_url(url)}: {_create_hint(url)}")
    if current != head:
        raise NoLedger(
            f"the ledger at {display_url(url)} is at schema revision {current}, this version "
            f"needs {head}: run `rollout-ledger db upgrade --db URL` first"
        )


def known_revisions() -> list[str]:
    """The schema revisions this version can migrate to, oldest first."""
    from alembic.script import ScriptDirectory

    from ledger import migrate

    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite:///unused.db"))
    return [r.revision for r in reversed(list(script.walk_revisions()))]
