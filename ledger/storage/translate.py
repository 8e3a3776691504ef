"""Driver errors into the ledger's error tree (``ledger.errors``), once, for every room."""

from __future__ import annotations

import re
import sqlite3

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
        return _refusal(exc, exc)
    return _translate_error(exc)


def _translate_error(exc: Exception) -> Exception:
    """The ledger error for a driver error (unchanged if it is not one)."""
    if isinstance(exc, LedgerError):
        return exc
    if isinstance(exc, IntegrityError | DataError):
        return _refusal(exc, exc.orig)
    if isinstance(exc, OperationalError | DBAPIError | OSError | ConnectionError):
        return Unavailable(f"ledger database unavailable: {exc}")
    # The group-commit writer runs the hot path on the raw ``sqlite3`` connection (its own
    # ``BEGIN IMMEDIATE``), so SQLite's errors also arrive unwrapped.
    if isinstance(exc, sqlite3.IntegrityError | sqlite3.DataError):
        return _refusal(exc, exc)
    if isinstance(exc, sqlite3.OperationalError):
        return Unavailable(f"ledger database unavailable: {exc}")
    # asyncpg raises its own connection errors outside SQLAlchemy's wrapping on connect.
    if type(exc).__module__.startswith("asyncpg"):
        return Unavailable(f"ledger database unavailable: {exc}")
    return exc


# What a violated constraint means, by the name ``ledger.tables``' naming convention gives it.
# Every constraint of the schema is listed (a test keeps the list whole): a new one needs a
# decision here.  Today each is a refused value; one that should mean a conflict or a state is
# one line to change.
REFUSED_BY: dict[str, type[LedgerError]] = {
    "ck_rollouts_version_nonnegative": InvalidInput,
    "ck_rollouts_state": InvalidInput,
    "ck_calls_lengths": InvalidInput,
    "ck_calls_status": InvalidInput,
    "uq_calls_rollout_id_model_call_id": InvalidInput,
    "uq_custody_rows_rollout_id_model_call_id_failure_reason": InvalidInput,
    "ck_deliveries_outcome": InvalidInput,
    "uq_deliveries_idempotency_key": InvalidInput,
    "ck_call_tokens_counts": InvalidInput,
    "ck_lineage_edges_status": InvalidInput,
    "uq_lineage_edges_child_id_parent_id": InvalidInput,
}

_SQLITE_UNIQUE = re.compile(r"^UNIQUE constraint failed: (.+)$")
_SQLITE_CHECK = re.compile(r"^CHECK constraint failed: (\w+)$")


def constraint_name(error: BaseException | None) -> str | None:
    """The name of the constraint a driver error reports, if it names one.

    asyncpg gives it (``constraint_name``, also behind SQLAlchemy's adapter as the cause);
    SQLite names a CHECK, and for a UNIQUE lists ``table.column``s, which the naming
    convention turns into the name (``uq_<table>_<columns>``)."""
    seen = 0
    while error is not None and seen < 4:
        name = getattr(error, "constraint_name", None)
        if isinstance(name, str) and name:
            return name
        text = str(error).splitlines()[0] if str(error) else ""
        if m := _SQLITE_CHECK.match(text):
            return m.group(1)
        if m := _SQLITE_UNIQUE.match(text):
            cols = [c.strip().split(".", 1) for c in m.group(1).split(",")]
            if all(len(c) == 2 for c in cols) and len({c[0] for c in cols}) == 1:
                return "_".join(["uq", cols[0][0], *(c[1] for c in cols)])
        error = error.__cause__
        seen += 1
    return None


def _refusal(exc: BaseException, orig: BaseException | None) -> LedgerError:
    """A value the database refused: the error its constraint's name decides (a refused value
    when it names none); the message names the constraint."""
    first = str(orig).splitlines()[0] if str(orig) else type(orig).__name__
    name = constraint_name(exc if orig is None else orig)
    cls = REFUSED_BY.get(name or "", InvalidInput)
    suffix = f" (constraint {name})" if name and name not in first else ""
    return cls(f"the database refused the value: {first}{suffix}")
