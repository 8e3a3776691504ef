"""The ``rollout-ledger`` console entry point: the ledger CLI plus the commands that run the
service (``serve``, ``demo``).  It lives in ``api/`` because it composes the web layer with the
domain; ``ledger/`` never imports ``api/``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from api.ui_cli import register as _register_ui
from ledger.cli import app
from ledger.cli_errors import fail, run_cli
from ledger.cli_ops import err

__all__ = ["app", "main"]


LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


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
        config: Annotated[
            Path | None, typer.Option(help="YAML config file (keys: docs/operations.md).")
        ] = None,
        host: Annotated[
            str | None, typer.Option(help="Listen address (default: 127.0.0.1).")
        ] = None,
        port: Annotated[int | None, typer.Option(help="Listen port (default: 8080).")] = None,
        allow_unauthenticated: Annotated[
            bool, typer.Option(help="Listen beyond loopback without API tokens (not advised).")
        ] = False,
        log_level: Annotated[
            str,
            typer.Option(help=f"Log level: {', '.join(LOG_LEVELS)}.", show_default=True),
        ] = "info",
        migrate_db: Annotated[
            bool,
            typer.Option(
                "--migrate/--no-migrate",
                help="Create or migrate the ledger at start (--no-migrate: refuse instead).",
                show_default=True,
            ),
        ] = True,
    ) -> None:
        """Run the capture proxy and the ledger API in one process."""
        import logging

        import uvicorn

        from api.app import create_app
        from api.server import serve_problem, uvicorn_options
        from ledger import migrate
        from ledger.cli_db import check_db_url
        from ledger.config import ConfigError, load_settings
        from ledger.redact import redact_url

        if log_level.lower() not in LOG_LEVELS:
            fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {log_level!r}")
        log_level = log_level.lower()
        try:
            settings = load_settings(config, upstream=upstream, db=db, host=host, port=port)
        except ConfigError as exc:
            fail(" ".join(str(exc).split()))
        check_db_url(settings.db)
        open_ok = allow_unauthenticated or settings.auth.allow_unauthenticated_remote
        if not settings.tokens and settings.host not in LOOPBACK and not open_ok:
            err.print(
                f"[red]error:[/] no API tokens are configured (set {settings.auth.tokens_env}="
                "TOKEN=ingest,trainer,audit,admin), so the ledger API would be open to the "
                f"network on {settings.host}. Listen on 127.0.0.1, configure tokens, or pass "
                "--allow-unauthenticated."
            )
            raise typer.Exit(2)
        if problem := serve_problem(settings):
            err.print(f"[red]error:[/] {problem}")
            raise typer.Exit(2)
        logging.basicConfig(
            level=5 if log_level == "trace" else log_level.upper(),
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
        )
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
            # httpx logs every upstream request at INFO: a line per pass-through or /tokenize
            # call (the proxy's own per-call line is at debug level too).
            logging.getLogger("httpx").setLevel(logging.WARNING)
        import asyncio

        from ledger.presence import display_url, require_ledger, sqlite_path

        path = sqlite_path(settings.db)
        if path is not None and not path.parent.is_dir():
            fail(
                f"the directory {path.parent} does not exist: create it first, or choose "
                "another --db"
            )
        try:
            if migrate_db:
                migrate.upgrade(settings.db)
            else:
                asyncio.run(require_ledger(settings.db))
        except Exception as exc:
            from ledger.cli_errors import explain

            fail(f"cannot prepare the ledger {display_url(settings.db)}: {explain(exc)}", 1)
        if settings.tokens:
            auth = "bearer tokens (proxy: capture capabilities or ingest tokens)"
        elif settings.host in LOOPBACK:
            auth = "NONE (loopback only)"
        else:
            auth = f"NONE: the ledger API is OPEN to the network on {settings.host}"
        err.print(
            f"rollout-ledger: ledger [bold]{display_url(settings.db)}[/], upstream "
            f"[bold]{redact_url(settings.upstream) or 'none: proxy routes answer 503'}[/], "
            f"auth {auth}, "
            f"http://{settings.host}:{settings.port}"
        )
        uvicorn.run(
            create_app(settings, freeze_gc=True),
            host=settings.host,
            port=settings.port,
            log_level=log_level,
            access_log=False,
            **uvicorn_options(settings),
        )

    @app.command("mint-capability")
    def mint_capability_cmd(
        rollout_id: Annotated[str, typer.Argument(help="The rollout the harness will write.")],
    ) -> None:
        """Print the capture capability for ROLLOUT_ID: the API key to give its harness.

        The secret comes from ROLLOUT_LEDGER_CAPTURE_SECRET (the value the service uses).
        """
        from ledger.capability import mint_capability
        from ledger.errors import LedgerError

        try:
            print(mint_capability(rollout_id))
        except LedgerError as exc:
            err.print(f"[red]error:[/] {exc.message}")
            raise typer.Exit(2) from None

    @app.command("sim")
    def sim(
        host: Annotated[str, typer.Option(help="Listen address.", show_default=True)] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Listen port.", show_default=True)] = 8000,
        model: Annotated[
            str, typer.Option(help="The model name it answers to.", show_default=True)
        ] = "smol",
        seed: Annotated[int, typer.Option(help="Seed of its replies.", show_default=True)] = 0,
        max_model_len: Annotated[
            int, typer.Option(help="Context length in tokens.", show_default=True)
        ] = 8192,
    ) -> None:
        """Serve a SIMULATED vLLM (OpenAI-compatible, token ids and log-probs, tool calls).

        A stand-in upstream for trying the proxy without a GPU: `rollout-ledger serve
        --upstream http://127.0.0.1:8000/v1`.  When a request offers tools it calls one until
        it sees a tool result, then answers in text.  Its words are not a model's.
        """
        import uvicorn

        from rollout_sim.agentic import make_sim_engine

        engine = make_sim_engine(model_name=model, seed=seed, max_model_len=max_model_len)
        err.print(
            f"rollout-ledger sim: SIMULATED vLLM, model [bold]{model}[/], "
            f"http://{host}:{port}/v1 (byte tokenizer; not a real model)"
        )
        uvicorn.run(engine.app, host=host, port=port, log_level="warning", access_log=False)

    @app.command("demo")
    def demo(
        db: Annotated[
            str | None,
            typer.Option(
                "--db", help="Ledger URL (default: a SQLite file in a temporary directory)."
            ),
        ] = None,
    ) -> None:
        """Run a scripted agent through the proxy against a SIMULATED engine, then rebuild it."""
        from api.demo import run_demo

        if db is not None:
            from ledger.cli_db import check_db_url

            check_db_url(db)
        result = run_demo(db)
        if result.get("mask_sample"):
            raise typer.Exit(1)


_register(app)
_register_ui(app)


def main() -> None:  # pragma: no cover - console entry point
    """The ``rollout-ledger`` console script: one-line errors, ``--debug`` for tracebacks."""
    sys.exit(run_cli(app))


if __name__ == "__main__":  # python -m api.cli
    main()
