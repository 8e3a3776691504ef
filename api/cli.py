"""The ``rollout-ledger`` console entry point: the ledger CLI plus the commands that run the
service (``serve``, ``demo``).  It lives in ``api/`` because it composes the web layer with the
domain; ``ledger/`` never imports ``api/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ledger.cli import app
from ledger.cli_ops import err
from ledger.config import ConfigError, load_settings

__all__ = ["app", "main"]


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        upstream: Annotated[
            str | None,
            typer.Option(
                help="Inference server base URL, with or without /v1.",
                envvar="ROLLOUT_LEDGER_UPSTREAM",
            ),
        ] = None,
        db: Annotated[
            str | None,
            typer.Option(
                "--db",
                envvar="ROLLOUT_LEDGER_DB",
                help="Database URL (default: a SQLite file here).",
            ),
        ] = None,
        config: Annotated[Path | None, typer.Option(help="YAML config file.")] = None,
        host: Annotated[
            str | None, typer.Option(help="Listen address (default 127.0.0.1).")
        ] = None,
        port: Annotated[int | None, typer.Option(help="Listen port (default 8080).")] = None,
        allow_unauthenticated: Annotated[
            bool, typer.Option(help="Listen beyond loopback without API tokens (not advised).")
        ] = False,
        log_level: Annotated[str, typer.Option()] = "info",
    ) -> None:
        """Run the capture proxy and the ledger API in one process."""
        import logging

        import uvicorn

        from api.app import create_app
        from ledger import migrate

        try:
            settings = load_settings(config, upstream=upstream, db=db, host=host, port=port)
        except ConfigError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        open_ok = allow_unauthenticated or settings.auth.allow_unauthenticated_remote
        if not settings.tokens and settings.host not in LOOPBACK and not open_ok:
            err.print(
                f"[red]error:[/] no API tokens are configured (set {settings.auth.tokens_env}="
                "TOKEN=ingest,trainer,audit,admin), so the ledger API would be open to the "
                f"network on {settings.host}. Listen on 127.0.0.1, configure tokens, or pass "
                "--allow-unauthenticated."
            )
            raise typer.Exit(2)
        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
        )
        try:
            migrate.upgrade(settings.db)
        except Exception as exc:
            err.print(f"[red]error:[/] cannot prepare the database {settings.db}: {exc}")
            raise typer.Exit(1) from None
        if settings.tokens:
            auth = "bearer tokens"
        elif settings.host in LOOPBACK:
            auth = "NONE (loopback only)"
        else:
            auth = f"NONE: the ledger API is OPEN to the network on {settings.host}"
        err.print(
            f"rollout-ledger: ledger [bold]{settings.db}[/], upstream "
            f"[bold]{settings.upstream or 'none: proxy routes answer 503'}[/], auth {auth}, "
            f"http://{settings.host}:{settings.port}"
        )
        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level=log_level,
            access_log=False,
            # The C parser (a dependency); h11 only if it is missing from the environment.
            http="httptools" if _has_httptools() else "h11",
        )

    @app.command("demo")
    def demo(
        db: Annotated[
            str | None, typer.Option("--db", help="Ledger URL (default: a fresh SQLite file).")
        ] = None,
    ) -> None:
        """Run a scripted agent through the proxy against a SIMULATED engine, then rebuild it."""
        from api.demo import run_demo

        result = run_demo(db)
        if result.get("mask_sample"):
            raise typer.Exit(1)


def _has_httptools() -> bool:
    import importlib.util

    return importlib.util.find_spec("httptools") is not None


_register(app)


def main() -> None:  # pragma: no cover - console entry point
    app()
