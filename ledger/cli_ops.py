"""``collect`` and ``audit`` commands (registered on the main Typer app in ``ledger.cli``)."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ledger.collect import CollectAborted, CollectReport, collect
from ledger.config import ConfigError, load_settings
from ledger.engine import DEFAULT_DB_URL

out = Console()
err = Console(stderr=True)

DbOption = Annotated[
    str,
    typer.Option("--db", envvar="ROLLOUT_LEDGER_DB", help="Database URL or http(s) ledger URL."),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


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
    t.add_row("malformed input lines", str(len(report.malformed_lines)))
    t.add_row("masked", f"{report.masked} ({report.mask_fraction:.1%})")
    for reason, n in report.mask_reasons.most_common():
        t.add_row(f"  masked: {reason}", str(n))
    for bucket, n in sorted(report.delivered_fraction.items()):
        t.add_row(f"  delivered_fraction {bucket}", str(n))
    for chains, n in sorted(report.chains.items()):
        t.add_row(f"  chains = {chains}", str(n))
    return t


def register(app: typer.Typer) -> None:
    audit_app = typer.Typer(
        help="Why were rollouts masked? Inspect the ledger.", no_args_is_help=True
    )
    app.add_typer(audit_app, name="audit")

    @app.command("collect")
    def collect_cmd(
        input: Annotated[Path, typer.Option("--input", "-i", help="Rollout results (JSONL).")],
        output: Annotated[Path, typer.Option("--output", "-o", help="Rebuilt rollouts (JSONL).")],
        db: DbOption = DEFAULT_DB_URL,
        config: Annotated[
            Path | None, typer.Option(help="YAML config (token_id_capture keys).")
        ] = None,
        max_mask_fraction: Annotated[
            float | None, typer.Option(help="Abort when the masked fraction exceeds this.")
        ] = None,
        min_samples: Annotated[
            int | None, typer.Option(help="Finalized rollouts before the limit applies.")
        ] = None,
        concurrency: Annotated[int, typer.Option(min=1, max=256)] = 8,
        deliver: Annotated[str, typer.Option(help="one | all-chains")] = "one",
        token: Annotated[str | None, typer.Option(envvar="ROLLOUT_LEDGER_TOKEN")] = None,
        as_json: JsonFlag = False,
    ) -> None:
        """Finalize rollout results, write each durably (fsync), then retire its records."""
        from ledger.gym import open_backend

        if deliver not in ("one", "all-chains"):
            raise typer.BadParameter("--deliver must be 'one' or 'all-chains'")
        if not input.exists():
            err.print(f"[red]error:[/] input file {input} does not exist")
            raise typer.Exit(2)
        try:
            settings = load_settings(config, db=db if db != DEFAULT_DB_URL else None)
        except ConfigError as exc:
            err.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
        cap = settings.token_id_capture
        limit = max_mask_fraction if max_mask_fraction is not None else cap.max_mask_fraction
        floor = min_samples if min_samples is not None else cap.mask_fraction_min_samples
        total = _count_lines(input)

        async def main() -> CollectReport:
            source = open_backend(settings.db, token=token)
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
                progress.update(
                    task, completed=r.written + r.skipped_already_written, masked=r.masked
                )

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

        try:
            report = asyncio.run(main())
        except CollectAborted as exc:
            if as_json:
                print(json.dumps(exc.report.as_dict(), indent=2))
            else:
                out.print(health_table(exc.report))
            err.print(f"[bold red]aborted:[/] {exc}")
            raise typer.Exit(3) from None
        for line, message in report.malformed_lines:
            err.print(
                f"[yellow]warning:[/] {input}:{line}: malformed row skipped: {message}",
                soft_wrap=True,
            )
        if as_json:
            print(json.dumps(report.as_dict(), indent=2))
        else:
            out.print(health_table(report))

    @audit_app.command("masked")
    def audit_masked(
        db: DbOption = DEFAULT_DB_URL,
        reason: Annotated[str | None, typer.Option(help="Only this mask reason.")] = None,
        since: Annotated[datetime | None, typer.Option(help="Only rollouts updated since.")] = None,
        limit: Annotated[int, typer.Option(min=1, max=10000)] = 100,
        as_json: JsonFlag = False,
    ) -> None:
        """Masked rollouts (latest build masked or failed), with their reasons."""
        items, _ = _run_audit(db, "list", masked=True, reason=reason, since=since, limit=limit)
        if as_json:
            print(json.dumps([_jsonable(vars_of(i)) for i in items], indent=2))
            return
        t = Table(title=f"masked rollouts ({len(items)})")
        for col in ("rollout", "state", "calls", "chains", "delivered", "outcome", "reasons"):
            t.add_column(col)
        for i in items:
            t.add_row(
                i.rollout_id,
                i.state,
                str(i.n_calls),
                str(i.chains or ""),
                "" if i.delivered_fraction is None else f"{i.delivered_fraction:.2f}",
                i.outcome or "",
                ", ".join(i.mask_reasons),
            )
        out.print(t)

    @audit_app.command("show")
    def audit_show(
        rollout_id: str, db: DbOption = DEFAULT_DB_URL, as_json: JsonFlag = False
    ) -> None:
        """One rollout in full: calls, edges, quarantines, incomplete events, deliveries."""
        detail = _run_audit(db, "show", rollout_id=rollout_id)
        if as_json:
            print(json.dumps(detail, indent=2, default=str))
            return
        r = detail["rollout"]
        out.print(
            f"[bold]{r['rollout_id']}[/] state={r['state']} incomplete={r['incomplete']} "
            f"version={r['version']} snapshot={r['snapshot_id']}"
        )
        calls = Table(title="calls")
        for col in ("call", "status", "prompt", "gen", "cumulative", "parent", "delta", "tokens"):
            calls.add_column(col)
        for c in detail["calls"]:
            calls.add_row(
                c["model_call_id"],
                c["status"],
                str(c["prompt_len"] or ""),
                str(c["generation_len"] or ""),
                str(c["cumulative_len"] or ""),
                c["parent_call_id"] or "",
                "yes" if c["prompt_is_delta"] else "",
                "yes" if c["has_tokens"] else "retired" if r["state"] == "retired" else "no",
            )
        out.print(calls)
        edges = Table(title="lineage edges")
        for col in ("child", "parent", "method", "status", "shared", "first mismatch"):
            edges.add_column(col)
        for e in detail["edges"]:
            mismatch = (
                "" if e["mismatch_pos"] is None else f"{e['mismatch_pos']} ({e['mismatch_kind']})"
            )
            edges.add_row(
                e["child"], e["parent"], e["method"], e["status"], str(e["shared_len"]), mismatch
            )
        out.print(edges)
        for title, rows, cols in (
            ("quarantines", detail["quarantines"], ("model_call_id", "reason", "detail")),
            (
                "incomplete events",
                detail["incomplete_events"],
                ("model_call_id", "reason", "detail"),
            ),
            (
                "deliveries",
                detail["deliveries"],
                (
                    "id",
                    "outcome",
                    "mask_reasons",
                    "snapshot_id",
                    "version",
                    "durable_ack_at",
                    "retired_at",
                ),
            ),
        ):
            t = Table(title=title)
            for col in cols:
                t.add_column(col)
            for row in rows:
                t.add_row(*(_cell(row.get(col)) for col in cols))
            out.print(t)

    @audit_app.command("stats")
    def audit_stats(
        db: DbOption = DEFAULT_DB_URL,
        since: Annotated[datetime | None, typer.Option()] = None,
        as_json: JsonFlag = False,
    ) -> None:
        """Counts by state, outcome and reason; mask fraction; delivered-fraction distribution."""
        stats = _run_audit(db, "stats", since=since)
        if as_json:
            print(json.dumps(stats, indent=2))
            return
        t = Table(title="ledger statistics")
        t.add_column("metric")
        t.add_column("value", justify="right")
        for section in (
            "rollouts_by_state",
            "builds_by_outcome",
            "mask_reasons",
            "incomplete_events_by_reason",
            "delivered_fraction_histogram",
            "chains_histogram",
        ):
            for key, n in stats[section].items():
                t.add_row(f"{section}: {key}", str(n))
        mf = stats["mask_fraction"]
        t.add_row("mask fraction", "n/a" if mf is None else f"{mf:.1%}")
        out.print(t)


def vars_of(obj: Any) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in obj.__slots__}


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in d.items()}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _run_audit(db: str, what: str, **kw: Any) -> Any:
    from ledger.errors import LedgerError
    from ledger.store import Audit, Ledger

    async def main() -> Any:
        led = Ledger(db, auto_migrate=True)
        try:
            audit = Audit(led)
            if what == "list":
                return await audit.list_rollouts(**kw)
            if what == "show":
                return await audit.rollout_detail(kw["rollout_id"])
            return await audit.stats(**kw)
        finally:
            await led.close()

    try:
        return asyncio.run(main())
    except LedgerError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from None
