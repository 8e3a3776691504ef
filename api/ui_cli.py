"""``rollout-ledger ui``: the audit page over an existing ledger, read-only, for a laptop.

Outside ``api/ui/`` so that ``rollout-ledger --help`` loads no web or database layer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from ledger.cli_ops import err

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class UiError(Exception):
    """Why the page cannot be served; printed as one line."""


def check_ledger(db: str) -> None:
    """Refuse a URL with no ledger behind it (this command never creates or migrates one)."""
    from ledger.cli_errors import explain
    from ledger.presence import require_ledger

    try:
        asyncio.run(require_ledger(db))
    except Exception as exc:
        raise UiError(explain(exc)) from None


def register(app: typer.Typer) -> None:
    @app.command("ui")
    def ui(
        db: Annotated[
            str,
            typer.Option(
                "--db",
                envvar="ROLLOUT_LEDGER_DB",
                help="Ledger database URL (sqlite+aiosqlite:///FILE or postgresql://...).",
            ),
        ],
        host: Annotated[str, typer.Option(help="Listen address.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Listen port.")] = 8090,
        tokenizer: Annotated[
            Path | None,
            typer.Option(
                envvar="ROLLOUT_LEDGER_TOKENIZER",
                help="A tokenizer.json, to show decoded text around drift positions.",
            ),
        ] = None,
        allow_unauthenticated: Annotated[
            bool, typer.Option(help="Listen beyond loopback without API tokens (not advised).")
        ] = False,
        log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
    ) -> None:
        """Serve the audit web page (read-only) at http://HOST:PORT/ui over a ledger."""
        from api.ui import create_ui_app
        from api.ui.tokens import TokenizerError, load_tokenizer
        from ledger.config import ConfigError, load_settings

        try:
            if log_level not in LOG_LEVELS:
                raise UiError(
                    f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {log_level!r}"
                )
            settings = load_settings(db=db, host=host, port=port)
            if not settings.tokens and host not in LOOPBACK and not allow_unauthenticated:
                raise UiError(
                    f"no API tokens are configured (set {settings.auth.tokens_env}=TOKEN=audit), "
                    f"so the audit page would be open to the network on {host}. Listen on "
                    "127.0.0.1, configure tokens, or pass --allow-unauthenticated."
                )
            decoder = load_tokenizer(tokenizer) if tokenizer is not None else None
            check_ledger(db)
        except (UiError, ConfigError, TokenizerError) as exc:
            err.print(f"[red]error:[/] {exc}", soft_wrap=True)
            raise typer.Exit(2) from None

        import uvicorn

        auth = "bearer tokens (audit scope)" if settings.tokens else "none (loopback only)"
        err.print(
            f"rollout-ledger ui: ledger {db}, auth {auth}, "
            f"tokenizer {decoder.source if decoder else 'none'}: "
            f"http://{host}:{port}/ui",
            soft_wrap=True,
        )
        uvicorn.run(
            create_ui_app(settings, tokenizer=decoder),
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
        )
