"""One line per error for the command line: what is wrong and what to do.

Every ``rollout-ledger`` command ends in ``run_cli``: an ordinary mistake (a missing or
unreachable database, a URL of the wrong kind, an unknown schema revision, a bad option value)
prints ``error: …`` on one line and exits non-zero; ``--debug`` (or ``ROLLOUT_LEDGER_DEBUG=1``)
shows the traceback instead.  Kept free of heavy imports: ``--help`` must stay fast.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, NoReturn

from ledger.redact import redact_text

__all__ = ["CliError", "explain", "fail", "run_cli", "strip_debug"]

DEBUG_HINT = "(--debug shows the traceback)"
URL_FORMS = "sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER@HOST/DB"


class CliError(Exception):
    """A refusal a command already phrased for a person; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error and stop the command with exit status ``code``."""
    import typer

    _say(message)
    raise typer.Exit(code)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    # SQLAlchemy appends "(Background on this error at: https://sqlalche.me/…)".
    line = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", line)
    # …and prefixes the driver's class: "(sqlite3.OperationalError) unable to open …".
    return re.sub(r"^\((?:[\w.]+)\)\s*", "", line).strip()


def explain(exc: BaseException) -> str:
    """The one-line message for an exception a command let through."""
    name = type(exc).__name__
    module = type(exc).__module__
    text = redact_text(_first_line(str(exc)))
    if isinstance(exc, CliError):
        return str(exc)
    from ledger.errors import AccessDenied, LedgerError, NoLedger, Unavailable

    if isinstance(exc, NoLedger):
        return redact_text(exc.message)
    if isinstance(exc, AccessDenied):
        return f"{text}: pass a token with the scope this command needs (--token)"
    if isinstance(exc, Unavailable):
        return (
            f"{text.removeprefix('ledger database unavailable: ')}: the ledger database is "
            "unreachable; check the --db URL and that the database server is running"
        )
    if isinstance(exc, LedgerError):
        return text
    if name == "ArgumentError" and module.startswith("sqlalchemy"):
        return f"not a database URL ({text}): use {URL_FORMS}"
    if name == "CommandError" and module.startswith("alembic"):
        from ledger import migrate

        return (
            f"{text}: this version's newest schema revision is {migrate.head_revision()} "
            "(use --revision head)"
        )
    if module.startswith(("asyncpg", "sqlalchemy", "sqlite3")) or isinstance(exc, ConnectionError):
        return (
            f"cannot use the database: {text}; check the --db URL and that the database "
            "server is running"
        )
    if isinstance(exc, ValueError):
        return text
    if isinstance(exc, OSError):
        return f"{text}"
    return f"{name}: {text} {DEBUG_HINT}"


def strip_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Remove ``--debug`` wherever it stands (before ``--``); say whether it was there."""
    debug = os.environ.get("ROLLOUT_LEDGER_DEBUG", "") not in ("", "0")
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            out.extend(argv[i:])
            break
        if arg == "--debug":
            debug = True
            continue
        out.append(arg)
    return out, debug


def _say(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def _kinds(exc: BaseException) -> set[str]:
    """Class names in ``exc``'s MRO: Typer may vendor its own copy of click's exceptions."""
    return {c.__name__ for c in type(exc).__mro__}


def run_cli(app: Any, argv: list[str] | None = None) -> int:
    """Run the Typer ``app`` the way the console script does; return the exit status."""
    args, debug = strip_debug(list(sys.argv[1:] if argv is None else argv))
    try:
        rc = app(args=args, prog_name="rollout-ledger", standalone_mode=False)
    except KeyboardInterrupt:
        _say("interrupted")
        return 130
    except CliError as exc:
        if debug:
            raise
        _say(str(exc))
        return exc.code
    except Exception as exc:
        kinds = _kinds(exc)
        if "Exit" in kinds:
            return int(getattr(exc, "exit_code", 0))
        if "NoArgsIsHelpError" in kinds:
            return 0  # the help was printed already
        if "Abort" in kinds:
            _say("interrupted")
            return 130
        if debug:
            raise
        if "UsageError" in kinds:
            ctx = getattr(exc, "ctx", None)
            where = ctx.command_path if ctx is not None else "rollout-ledger"
            _say(f"{exc.format_message()} (see `{where} --help`)")  # type: ignore[attr-defined]
            return int(getattr(exc, "exit_code", 2))
        if "ClickException" in kinds:
            _say(exc.format_message())  # type: ignore[attr-defined]
            return int(getattr(exc, "exit_code", 1))
        _say(explain(exc))
        return 1
    return rc if isinstance(rc, int) else 0
