"""Driver errors into the ledger's error tree (``ledger.errors``), once, for every room."""

from __future__ import annotations

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError

from ledger.errors import (
    InvalidInput,
    LedgerError,
    Unavailable,
)


def _translate_pg_error(exc: Exception) -> Exception:
    """The ledger error for an asyncpg error on the hot path (unchanged if it is not one)."""
    from asyncpg import exceptions as pg

    if isinstance(exc, pg.IntegrityConstraintViolationError | pg.DataError):
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return InvalidInput(f"the database refused the value: {first}")
    return _translate_error(exc)


def _translate_error(exc: Exception) -> Exception:
    """The ledger error for a driver error (unchanged if it is not one)."""
    if isinstance(exc, LedgerError):
        return exc
    if isinstance(exc, IntegrityError | DataError):
        first = str(exc.orig).splitlines()[0] if str(exc.orig) else type(exc.orig).__name__
        return InvalidInput(f"the database refused the value: {first}")
    if isinstance(exc, OperationalError | DBAPIError | OSError | ConnectionError):
        return Unavailable(f"ledger database unavailable: {exc}")
    # asyncpg raises its own connection errors outside SQLAlchemy's wrapping on connect.
    if type(exc).__module__.startswith("asyncpg"):
        return Unavailable(f"ledger database unavailable: {exc}")
    return exc
