"""The database URL checks every command shares (kept apart from ``ledger.cli`` so the command
modules can use them without importing the Typer app that registers them)."""

from __future__ import annotations

from typing import Any

from ledger.cli_errors import fail

__all__ = ["check_db_url", "open_ledger"]


def check_db_url(db: str, *, allow_http: bool = False) -> str:
    """Refuse a URL that cannot be a ledger, in one line; returns it unchanged."""
    if allow_http and db.startswith(("http://", "https://")):
        return db
    from sqlalchemy.exc import ArgumentError

    from ledger.cli_errors import URL_FORMS
    from ledger.engine import normalize_url

    try:
        normalize_url(db)
    except ArgumentError:
        also = " or the http(s):// URL of a ledger service" if allow_http else ""
        fail(f"--db {db!r} is not a database URL: use {URL_FORMS}{also}")
    except ValueError as exc:
        fail(str(exc))
    return db


def open_ledger(db: str) -> Any:
    """A ``Ledger`` over an existing ledger only: never creates or migrates (``NoLedger``)."""
    from ledger.store import Ledger

    check_db_url(db)
    return Ledger(db, check_schema=True)
