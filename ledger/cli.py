"""The ``rollout-ledger`` command line.

Imports stay light at module level (``--help`` must answer quickly): SQLAlchemy, the store and
the web layer load inside the commands that use them.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from ledger.cli_db import check_db_url, open_ledger
from ledger.cli_errors import fail, run_cli

# ``ledger.engine.DEFAULT_DB_URL`` (pinned equal by tests/test_cli.py), without importing
# SQLAlchemy for ``--help``.
DEFAULT_DB_URL = "sqlite+aiosqlite:///rollout-ledger.db"

# Commands in the order an operator meets them; ``--help`` lists them so.
WORKFLOW_ORDER = (
    "serve",
    "sim",
    "demo",
    "collect",
    "audit",
    "ui",
    "db",
    "sweep",
    "conformance",
)


class WorkflowGroup(TyperGroup):
    """Lists commands in workflow order (unknown ones after, in creation order)."""

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        rank = {n: i for i, n in enumerate(WORKFLOW_ORDER)}
        return sorted(names, key=lambda n: (rank.get(n, len(rank)), names.index(n)))


app = typer.Typer(
    name="rollout-ledger",
    cls=WorkflowGroup,
    help="Capture exact training tokens from agent harnesses into a SQL ledger.\n\n"
    "Workflow: `serve` the capture proxy in front of vLLM (or `sim`), point harnesses at "
    "/ng-rollout/<id>/training-token-capture/, `collect` the rebuilt rollouts, `audit` why "
    "any was masked.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
db_app = typer.Typer(help="Create, migrate and inspect the ledger's schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")
console = Console(stderr=True, soft_wrap=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollout-ledger")
    except PackageNotFoundError:  # pragma: no cover - running from a tree without install
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"rollout-ledger {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help="Show the full traceback of an error (anywhere on the command line; also "
            "ROLLOUT_LEDGER_DEBUG=1).",
        ),
    ] = False,
) -> None:
    """Global options."""


DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="ROLLOUT_LEDGER_DB",
        help="Ledger database URL: sqlite+aiosqlite:///FILE or postgresql+asyncpg://USER@HOST/DB.",
        show_default=True,
    ),
]


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Kept for callers that ``raise _fail(...)``: prints the error, returns the exit."""
    try:
        fail(message, code)
    except typer.Exit as exc:
        return exc


@db_app.command("upgrade")
def db_upgrade(
    db: DbOption = DEFAULT_DB_URL,
    revision: Annotated[
        str, typer.Option(help="Target schema revision.", show_default=True)
    ] = "head",
) -> None:
    """Create the ledger or migrate it (safe to run from several processes at once)."""
    from ledger import migrate
    from ledger.presence import known_revisions, sqlite_path

    check_db_url(db)
    path = sqlite_path(db)
    if path is not None and not path.parent.is_dir():
        fail(f"the directory {path.parent} does not exist: create it first, or choose another --db")
    known = known_revisions()
    if revision not in ("head", "heads") and revision not in known:
        fail(f"unknown schema revision {revision!r}: use head, or one of {', '.join(known)}")
    migrate.upgrade(db, revision)
    current = asyncio.run(migrate.current_revision(db))
    console.print(f"schema at revision [bold]{current}[/]")


@db_app.command("current")
def db_current(db: DbOption = DEFAULT_DB_URL) -> None:
    """Print the database's schema revision and the head this version expects."""
    from ledger import migrate
    from ledger.presence import require_ledger, sqlite_path

    check_db_url(db)
    path = sqlite_path(db)
    if path is not None and not path.is_file():
        asyncio.run(require_ledger(db))  # raises NoLedger, creates nothing
    current = asyncio.run(migrate.current_revision(db))
    if current is None:
        asyncio.run(require_ledger(db))  # no ledger tables: NoLedger, nothing created
    typer.echo(f"current: {current}\nhead: {migrate.head_revision()}")


@app.command()
def sweep(
    db: DbOption = DEFAULT_DB_URL,
    older_than_hours: Annotated[
        float,
        typer.Option(help="Remove retired tombstones older than this many hours.", min=0),
    ] = 24.0,
) -> None:
    """Remove retired rollouts' tombstones older than the given age."""
    from datetime import timedelta

    async def main() -> int:
        led = open_ledger(db)
        try:
            result: int = await led.sweep(timedelta(hours=older_than_hours))
            return result
        finally:
            await led.close()

    n = asyncio.run(main())
    typer.echo(f"removed {n} tombstone(s) older than {older_than_hours:g} h")


def load_object(path: str) -> Any:
    """Import ``module.path:Name`` (or ``module.path.Name``)."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ValueError(f"expected an import path like package.module:ClassName; got {path!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {path!r}: {exc}") from exc


def _kwargs(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE; got {p!r}")
        out[key] = value
    return out


@app.command()
def conformance(
    sink: Annotated[
        str, typer.Option(help="Sink class import path.", show_default=True)
    ] = "ledger.gym:CaptureSink",
    source: Annotated[
        str, typer.Option(help="Source class import path.", show_default=True)
    ] = "ledger.gym:CaptureSource",
    lineage: Annotated[
        str,
        typer.Option(
            help="Lineage store import path ('' to skip the lineage checks).", show_default=True
        ),
    ] = "ledger.gym:CaptureLineageStore",
    kwarg: Annotated[
        list[str] | None,
        typer.Option("--kwarg", "-k", help="KEY=VALUE passed to every class (repeatable)."),
    ] = None,
    db: Annotated[
        str | None,
        typer.Option(
            "--db",
            help="Shortcut for --kwarg url=URL (a database URL, or http(s):// of a ledger "
            "service with --kwarg token=TOKEN having both the ingest and trainer scopes).",
        ),
    ] = None,
) -> None:
    """Run the conformance kit against capture classes named by import path.

    Every rollout the kit writes is deleted again at the end.
    """
    from ledger.conformance import ConformanceError, run_conformance

    try:
        kwargs: dict[str, Any] = _kwargs(kwarg or [])
        if db:
            kwargs.setdefault("url", db)
        if "url" not in kwargs and os.environ.get("ROLLOUT_LEDGER_DB"):
            kwargs["url"] = os.environ["ROLLOUT_LEDGER_DB"]
        sink_cls, source_cls = load_object(sink), load_object(source)
        lineage_cls = load_object(lineage) if lineage else None
    except ValueError as exc:
        raise _fail(str(exc)) from None

    async def main() -> list[str]:
        return await run_conformance(
            sink_factory=lambda: sink_cls(**kwargs),
            source_factory=lambda: source_cls(**kwargs),
            lineage_factory=(lambda: lineage_cls(**kwargs)) if lineage_cls else None,
        )

    try:
        passed = asyncio.run(main())
    except ConformanceError as exc:
        raise _fail(f"conformance check {exc.check} failed: {exc.detail}", 1) from None
    for name in passed:
        typer.echo(f"PASS {name}")
    typer.echo(f"{len(passed)} checks passed")


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(run_cli(app))


def _register_subcommands() -> None:
    """``collect`` and the ``audit`` sub-app, in the order ``--help`` lists them."""
    from ledger import cli_audit, cli_ops

    app.command("collect")(cli_ops.collect_cmd)
    app.add_typer(cli_audit.audit_app(), name="audit")


_register_subcommands()

__all__ = ["DEFAULT_DB_URL", "app", "check_db_url", "main", "open_ledger"]
