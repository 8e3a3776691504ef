"""The package's public surface is exactly ``ledger.__all__`` (httpx's exported-members test),
and importing it stays light (issue #9; issue #10: ``from ledger import TokenEntry``)."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import ledger
import ledger.errors as ledger_errors


def test_all_is_sorted_and_every_name_resolves_to_a_ledger_object() -> None:
    assert ledger.__all__ == sorted(ledger.__all__)
    assert len(set(ledger.__all__)) == len(ledger.__all__)
    for name in ledger.__all__:
        value = getattr(ledger, name)
        assert value.__module__.startswith("ledger."), (name, value.__module__)


def test_public_members_are_exactly_all() -> None:
    for name in ledger.__all__:
        getattr(ledger, name)  # load every lazy name
    public = {
        name
        for name, value in vars(ledger).items()
        if not name.startswith("_") and not isinstance(value, ModuleType)
    }
    assert public == set(ledger.__all__)
    assert {n for n in dir(ledger) if not n.startswith("_")} >= set(ledger.__all__)


def test_unknown_names_raise_attribute_error() -> None:
    try:
        ledger.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("ledger.NoSuchThing resolved")


def test_the_error_tree_is_exported_whole() -> None:
    errors = {
        name
        for name in ledger.__all__
        if isinstance(getattr(ledger, name), type)
        and issubclass(getattr(ledger, name), ledger.LedgerError)
    }
    assert errors == set(ledger_errors.__all__)


def test_importing_a_record_does_not_load_the_storage_or_http_stack() -> None:
    code = (
        "import sys; import ledger; from ledger import TokenEntry, ParentResolutionStatus, "
        "LineageResolution, stamp_continuation; "
        "print(sorted(m for m in ('sqlalchemy', 'asyncpg', 'aiosqlite', 'fastapi', 'httpx', "
        "'uvicorn', 'alembic') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
