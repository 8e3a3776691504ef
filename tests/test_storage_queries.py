"""The named-query discipline: the storage rooms and the Gym read modules build no SQL inline
and never branch on the database's name; ``ledger.storage.queries`` names every statement and
``ledger.storage.dialect`` holds what the two databases spell differently."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import sqlalchemy as sa

from ledger.storage import queries
from ledger.storage.dialect import PostgresDialect, SqliteDialect, sql_dialect
from ledger.store import Ledger
from ledger.tables import Base

ROOT = Path(__file__).resolve().parent.parent

# Modules that execute statements built by ``ledger.storage.queries`` (the hot path's plain SQL
# lives in ``statements``).
CALLERS = (
    "ledger/storage/core.py",
    "ledger/storage/capture.py",
    "ledger/storage/snapshot.py",
    "ledger/storage/lineage.py",
    "ledger/storage/lifecycle.py",
    "ledger/storage/audit.py",
    "ledger/audit_views.py",
    "ledger/gym_store.py",
    "ledger/custody.py",
    "ledger/gym_lineage.py",
)
# A table's statement constructors take no arguments (``calls.update()``).
TABLE_METHODS = {"insert", "update", "delete"}
# Building any of these is assembling SQL.
BUILDING = {
    "select",
    "insert",
    "update",
    "delete",
    "exists",
    "where",
    "join",
    "outerjoin",
    "group_by",
    "order_by",
    "limit",
    "returning",
    "cte",
    "union_all",
    "subquery",
    "with_for_update",
    "on_conflict_do_nothing",
    "table_valued",
}


def _calls(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Constant):
                continue  # a method of a literal: ", ".join(...)
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in TABLE_METHODS and (node.args or node.keywords):
                continue  # ``hasher.update(data)``, ``dict.update(...)``: not ``table.update()``
            found.append((node.lineno, name))
    return found


@pytest.mark.parametrize("module", CALLERS)
def test_callers_build_no_sql_inline(module: str) -> None:
    path = ROOT / module
    built = [f"{module}:{line} {name}()" for line, name in _calls(path) if name in BUILDING]
    assert built == []
    tree = ast.parse(path.read_text(), filename=str(path))
    imported = [
        n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("sqlalchemy")
    ] + [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    # Connections and engines may be named; the expression language may not be used.
    assert [m for m in imported if m == "sqlalchemy" or m.startswith("sqlalchemy.dialects")] == []


# ``core`` still picks its transaction machinery by database (the SQLite group-commit writer or
# the asyncpg pools); its statements come from ``queries`` like everyone's.
_NO_BRANCHES = [m for m in CALLERS if m != "ledger/storage/core.py"] + ["ledger/storage/queries.py"]


@pytest.mark.parametrize("module", _NO_BRANCHES)
def test_no_module_branches_on_the_database_name(module: str) -> None:
    """Only ``ledger.storage.dialect`` knows how each database spells a statement."""
    tree = ast.parse((ROOT / module).read_text())
    names = {"sqlite", "postgresql"}
    compared = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(
            isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators]
        )
    ]
    assert compared == []


def test_every_builder_is_named_and_says_what_it_answers() -> None:
    builders = [
        (name, fn)
        for name, fn in vars(queries).items()
        if inspect.isfunction(fn) and fn.__module__ == queries.__name__
    ]
    assert len(builders) > 40
    undocumented = [name for name, fn in builders if not (fn.__doc__ or "").strip()]
    assert undocumented == []
    # The first line alone says what the statement answers or changes.
    summaries = {name: (fn.__doc__ or "").strip().splitlines()[0] for name, fn in builders}
    assert [name for name, line in summaries.items() if not line.endswith(".")] == []


def test_every_table_goes_by_its_sql_name() -> None:
    for name, table in Base.metadata.tables.items():
        assert getattr(queries, name) is table


def test_the_dialect_is_chosen_by_name() -> None:
    assert isinstance(sql_dialect("sqlite"), SqliteDialect)
    assert isinstance(sql_dialect("postgresql"), PostgresDialect)
    with pytest.raises(ValueError, match="sqlite or postgresql"):
        sql_dialect("mysql")


async def test_the_ledger_picks_its_dialect_once_from_its_engine(
    ledger: Ledger, backend: str
) -> None:
    assert ledger.sql is sql_dialect(ledger.engine.dialect.name)
    assert ledger.sql.name == ("sqlite" if backend == "sqlite" else "postgresql")


async def test_json_array_holds_matches_whole_elements_only(ledger: Ledger) -> None:
    """The element test on a JSON array (both databases): an exact element, never a substring,
    at the top level or under a path."""
    sql = ledger.sql
    doc = sa.literal({"reasons": ["masked_tool", "x"]}, sa.JSON)
    array = sa.literal(["masked_tool", "x"], sa.JSON)
    probes = {
        "top_exact": sql.json_array_holds(array, "masked_tool"),
        "top_substring": sql.json_array_holds(array, "masked"),
        "path_exact": sql.json_array_holds(doc, "x", "$.reasons"),
        "path_missing": sql.json_array_holds(doc, "y", "$.reasons"),
    }
    query = sa.select(*(sa.case((test, 1), else_=0).label(k) for k, test in probes.items()))
    async with ledger._read() as conn:
        row = (await conn.execute(query)).one()
    assert row._asdict() == {
        "top_exact": 1,
        "top_substring": 0,
        "path_exact": 1,
        "path_missing": 0,
    }
