"""The ``rollout-ledger`` command line."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from datetime import timedelta
from typing import Annotated, Any

import typer
from rich.console import Console

from ledger.engine import DEFAULT_DB_URL

app = typer.Typer(
    name="rollout-ledger",
    help="Capture exact training tokens from agent harnesses into a SQL ledger.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
app.add_typer(db_app, name="db")
console = Console(stderr=True)

DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="ROLLOUT_LEDGER_DB",
        help="SQLAlchemy URL: sqlite+aiosqlite:///FILE or postgresql+asyncpg://USER@HOST/DB.",
    ),
]


def _fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


@db_app.command("upgrade")
def db_upgrade(
    db: DbOption = DEFAULT_DB_URL,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Migrate the ledger database (safe to run from several processes at once)."""
    from ledger import migrate

    try:
        migrate.upgrade(db, revision)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    current = asyncio.run(migrate.current_revision(db))
    console.print(f"schema at revision [bold]{current}[/]")


@db_app.command("current")
def db_current(db: DbOption = DEFAULT_DB_URL) -> None:
    """Print the database's schema revision and the head this version expects."""
    from ledger import migrate

    current = asyncio.run(migrate.current_revision(db))
    typer.echo(f"current: {current}\nhead: {migrate.head_revision()}")


@app.command()
def sweep(
    db: DbOption = DEFAULT_DB_URL,
    older_than_hours: Annotated[
        float, typer.Option(help="Remove retired tombstones older than this.")
    ] = 24.0,
) -> None:
    """Remove retired rollouts' tombstones older than the given age."""
    from ledger.store import Ledger

    async def main() -> int:
        led = Ledger(db, auto_migrate=True)
        try:
            return await led.sweep(timedelta(hours=older_than_hours))
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
    sink: Annotated[str, typer.Option(help="Sink class import path.")] = "ledger.gym:CaptureSink",
    source: Annotated[
        str, typer.Option(help="Source class import path.")
    ] = "ledger.gym:CaptureSource",
    lineage: Annotated[
        str, typer.Option(help="Lineage store import path ('' to skip the lineage checks).")
    ] = "ledger.gym:CaptureLineageStore",
    kwarg: Annotated[
        list[str] | None,
        typer.Option("--kwarg", "-k", help="KEY=VALUE passed to every class (repeatable)."),
    ] = None,
    db: Annotated[str | None, typer.Option("--db", help="Shortcut for --kwarg url=URL.")] = None,
) -> None:
    """Run the conformance kit against capture classes named by import path."""
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
        raise _fail(f"conformance check [bold]{exc.check}[/] failed: {exc.detail}", 1) from None
    for name in passed:
        typer.echo(f"PASS {name}")
    typer.echo(f"{len(passed)} checks passed")


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())


def _register_subcommands() -> None:
    from ledger import cli_ops

    cli_ops.register(app)


_register_subcommands()
