"""The ``collect`` command and the options and output helpers the commands share (``collect`` and
the ``audit`` sub-app of ``ledger.cli_audit`` are registered on the main app in ``ledger.cli``).

Timestamps print in ISO 8601 UTC (``2026-12-01T14:32:21Z``); ids are never truncated (columns
fold on a terminal; ``--wide``, or any output that is not a terminal, prints each row on one
line).
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ledger.cli_errors import fail

if TYPE_CHECKING:
    from ledger.collect import CollectReport

DEFAULT_DB_URL = "sqlite+aiosqlite:///rollout-ledger.db"

# The safe default guard (issue 14 point 4): a run where more than half of at least ten
# finalized rollouts are masked stops instead of writing mostly token-less data.  Gym's own
# config default is ``null`` (off); set ``--max-mask-fraction 1`` to turn the guard off.
DEFAULT_MAX_MASK_FRACTION = 0.5
DEFAULT_MIN_SAMPLES = 10

err = Console(stderr=True, soft_wrap=True)

DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="ROLLOUT_LEDGER_DB",
        help="Ledger: a database URL (sqlite+aiosqlite:///FILE, postgresql+asyncpg://…) or the "
        "http(s):// URL of a `rollout-ledger serve`.",
        show_default=True,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="ROLLOUT_LEDGER_TOKEN",
        help="API token for an http(s):// ledger.",
        show_default=False,
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
WideFlag = Annotated[
    bool,
    typer.Option(
        "--wide", help="One line per row, nothing folded (the default when not on a terminal)."
    ),
]

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(value: str | None, *, now: datetime | None = None) -> datetime | None:
    """``1h``, ``30m``, ``2d`` (ago), or an ISO 8601 time (UTC when it has no offset)."""
    if value is None or value == "":
        return None
    match = _RELATIVE.match(value)
    if match:
        delta = timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
        return (now or datetime.now(UTC)) - delta
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        fail(
            f"--since {value!r} is neither a relative age (30m, 1h, 2d, 1w) nor an ISO 8601 "
            "time (2026-12-01T14:00:00Z)"
        )
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def ts(value: Any) -> str:
    """One timestamp format everywhere: ISO 8601 UTC to the second, ``Z`` suffix."""
    if value is None or value == "":
        return ""
    when = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    when = when if when.tzinfo else when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stdout(wide: bool) -> Console:
    probe = Console()
    if wide or not probe.is_terminal:
        return Console(width=100_000, soft_wrap=True)
    return probe


def _table(title: str, cols: tuple[str, ...]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in cols:
        t.add_column(col, overflow="fold")
    return t


def _count_lines(path: Path) -> int:
    with path.open("rb") as fh:
        return sum(1 for line in fh if line.strip())


def health_table(report: CollectReport) -> Table:
    t = Table(title="collection health", show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("rows read", str(report.rows_in))
    t.add_row("finalized", str(report.finalized))
    t.add_row("written (fsynced)", str(report.written))
    t.add_row("retired", str(report.retired + report.retired_on_resume))
    t.add_row("already written (resume)", str(report.skipped_already_written))
    if report.reprocessed_source_errors:
        t.add_row("rebuilt after a ledger failure", str(report.reprocessed_source_errors))
    t.add_row("malformed input lines", str(len(report.malformed_lines)))
    t.add_row("duplicate rollout ids (not delivered)", str(len(report.duplicate_rows)))
    if report.already_retired:
        t.add_row("delivered by an earlier run, not here", str(len(report.already_retired)))
    t.add_row("masked", f"{report.masked} ({report.mask_fraction:.1%})")
    for reason, n in report.mask_reasons.most_common():
        t.add_row(f"  masked: {reason}", str(n))
    for bucket, n in sorted(report.delivered_fraction.items()):
        t.add_row(f"  delivered_fraction {bucket}", str(n))
    for chains, n in sorted(report.chains.items()):
        t.add_row(f"  chains = {chains}", str(n))
    return t


# --------------------------------------------------------------------------- audit sources


def collect_cmd(
    input: Annotated[
        Path,
        typer.Option(
            "--input",
            "-i",
            help="Rollout results, one JSON object per line (see docs/operations.md).",
        ),
    ],
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="Rebuilt rollouts (JSONL); appended to, so a re-run resumes. Its directory "
            "must exist.",
        ),
    ],
    db: DbOption = DEFAULT_DB_URL,
    config: Annotated[
        Path | None,
        typer.Option(help="YAML config; its token_id_capture keys set the limits below."),
    ] = None,
    max_mask_fraction: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Stop when more than this fraction of finalized rollouts is masked "
            f"(default: token_id_capture.max_mask_fraction, else {DEFAULT_MAX_MASK_FRACTION}; "
            "1 turns the guard off).",
            show_default=False,
        ),
    ] = None,
    min_samples: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Finalized rollouts before the mask-fraction guard can stop the run "
            f"(default: token_id_capture.mask_fraction_min_samples, else "
            f"{DEFAULT_MIN_SAMPLES}).",
            show_default=False,
        ),
    ] = None,
    concurrency: Annotated[
        int, typer.Option(min=1, max=256, help="Rollouts finalized at once.", show_default=True)
    ] = 8,
    deliver: Annotated[
        str,
        typer.Option(
            help="one: the rollout's terminal chain; all-chains: one row per verified chain.",
            show_default=True,
        ),
    ] = "one",
    token: TokenOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Rebuild rollout results from the ledger, write each durably (fsync), then retire it.

    Stops (exit 1, nothing masked written) when the ledger fails or refuses the token;
    stops (exit 3) when the mask-fraction guard fires.  Re-run it with the same arguments
    to resume: written rows are kept, the rest are processed.
    """
    from ledger.cli_db import check_db_url
    from ledger.collect import CollectAborted, CollectFailed, CollectRefused, check_paths
    from ledger.config import ConfigError, load_settings

    if deliver not in ("one", "all-chains"):
        fail(f"--deliver must be 'one' or 'all-chains'; got {deliver!r}")
    try:
        check_paths(input, output)
    except CollectRefused as exc:
        fail(str(exc))
    try:
        settings = load_settings(config, db=db if db != DEFAULT_DB_URL else None)
    except ConfigError as exc:
        fail(" ".join(str(exc).split()))
    check_db_url(settings.db, allow_http=True)
    cap = settings.token_id_capture
    limit = max_mask_fraction
    if limit is None and "max_mask_fraction" in cap.model_fields_set:
        limit = cap.max_mask_fraction
    elif limit is None:
        limit = DEFAULT_MAX_MASK_FRACTION
    floor = min_samples
    if floor is None:
        floor = (
            cap.mask_fraction_min_samples
            if "mask_fraction_min_samples" in cap.model_fields_set
            else DEFAULT_MIN_SAMPLES
        )
    if limit is not None and limit >= 1.0:
        limit = None
    try:
        report = _collect(
            settings.db, token, input, output, limit, floor, concurrency, deliver, as_json
        )
    except CollectFailed as exc:
        _print_report(exc.report, as_json)
        fail(
            f"{exc} — fix the ledger or the token, then re-run the same command: rows "
            "already written are kept, the rest are processed",
            1,
        )
    except CollectAborted as exc:
        _print_report(exc.report, as_json)
        fail(f"aborted: {exc}", 3)
    except CollectRefused as exc:
        fail(str(exc))
    for line, message in report.malformed_lines:
        err.print(f"[yellow]warning:[/] {input}:{line}: malformed row skipped: {message}")
    for line, rid, first in report.duplicate_rows:
        err.print(
            f"[yellow]warning:[/] {input}:{line}: rollout {rid} already appears on line "
            f"{first}; only line {first} is delivered (duplicate rollout id)"
        )
    for line, rid in report.already_retired:
        err.print(
            f"[yellow]warning:[/] {input}:{line}: rollout {rid} was already delivered and "
            "retired by an earlier collect; its row is not in this output and cannot be "
            "rebuilt"
        )
    _print_report(report, as_json)
    if report.already_retired:
        fail(
            f"{len(report.already_retired)} rollout(s) were delivered by an earlier run into "
            f"another output (or one since deleted) and are not in {output}: restore that "
            "output; their records are retired",
            1,
        )


def _collect(
    db: str,
    token: str | None,
    input: Path,
    output: Path,
    limit: float | None,
    floor: int,
    concurrency: int,
    deliver: str,
    as_json: bool,
) -> CollectReport:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from ledger.collect import collect
    from ledger.gym import open_backend

    total = _count_lines(input)

    async def main() -> CollectReport:
        if not db.startswith(("http://", "https://")):
            from ledger.presence import require_ledger

            await require_ledger(db)  # before the progress bar: a missing ledger is one line
        source = open_backend(db, token=token)
        progress = Progress(
            TextColumn("[bold]collect"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("masked {task.fields[masked]}"),
            TimeElapsedColumn(),
            console=err,
            disable=as_json,
        )
        task = progress.add_task("rows", total=total, masked=0)

        def tick(r: CollectReport) -> None:
            progress.update(task, completed=r.written + r.skipped_already_written, masked=r.masked)

        try:
            with progress:
                return await collect(
                    source,
                    input,
                    output,
                    max_mask_fraction=limit,
                    min_samples=floor,
                    concurrency=concurrency,
                    deliver=deliver,
                    on_progress=tick,
                )
        finally:
            await source.close()

    return asyncio.run(main())


def _print_report(report: CollectReport, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        _stdout(True).print(health_table(report))
