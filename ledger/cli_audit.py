"""The ``audit`` commands (``list``, ``masked``, ``show``, ``stats``): why were rollouts masked.

They read a ledger directly (a database URL) or through a ``rollout-ledger serve`` (an
``http(s)://`` URL with ``--token`` of the ``audit`` scope), and never create or migrate one.
Output is the same either way: timestamps in ISO 8601 UTC, ids never truncated (``--wide``, or
any output that is not a terminal, prints each row on one line).
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ledger.cli_errors import fail
from ledger.cli_ops import (
    DEFAULT_DB_URL,
    DbOption,
    JsonFlag,
    TokenOption,
    WideFlag,
    _stdout,
    _table,
    parse_since,
    ts,
)

SinceOption = Annotated[
    str | None,
    typer.Option(help="Only rollouts updated since: 30m, 1h, 2d, or an ISO 8601 time."),
]
LimitOption = Annotated[
    int, typer.Option(min=1, max=100_000, help="At most this many rows.", show_default=True)
]


class _LocalAudit:
    """Audit queries straight from a database (never creates or migrates it)."""

    def __init__(self, db: str) -> None:
        from ledger.cli_db import open_ledger

        self._ledger = open_ledger(db)

    async def list(self, **kw: Any) -> list[dict[str, Any]]:
        from ledger.store import Audit

        items, _ = await Audit(self._ledger).list_rollouts(**kw)
        return [_summary_dict(i) for i in items]

    async def show(self, rollout_id: str) -> dict[str, Any]:
        from ledger.store import Audit

        detail: dict[str, Any] = await Audit(self._ledger).rollout_detail(rollout_id)
        return detail

    async def stats(self, since: datetime | None) -> dict[str, Any]:
        from ledger.store import Audit

        await self._ledger.ensure_schema()  # NoLedger before any query
        stats: dict[str, Any] = await Audit(self._ledger).stats(since=since)
        return stats

    async def close(self) -> None:
        await self._ledger.close()


class _RemoteAudit:
    """The same queries through a ledger service's ``/ledger/v1`` audit routes."""

    def __init__(self, url: str, token: str | None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url + "/ledger/v1", headers=headers, timeout=60.0
        )

    async def _get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        import httpx

        from ledger.errors import AccessDenied, NotFound, Unavailable

        try:
            resp = await self._http.get(path, params=params)
        except httpx.HTTPError as exc:
            raise Unavailable(f"ledger service unreachable at {self.url}: {exc}") from exc
        if resp.status_code == 200:
            return resp.json()
        try:
            message = str(resp.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = resp.text[:200] or f"HTTP {resp.status_code}"
        if resp.status_code in (401, 403):
            raise AccessDenied(
                f"the ledger service at {self.url} refused the token ({message}); audit needs "
                "a token with the audit scope"
            )
        if resp.status_code == 404:
            raise NotFound(message)
        raise Unavailable(
            f"the ledger service at {self.url} answered {resp.status_code}: {message}"
        )

    async def list(self, **kw: Any) -> list[dict[str, Any]]:
        limit = int(kw.pop("limit"))
        params = {k: v for k, v in kw.items() if v is not None}
        if isinstance(params.get("since"), datetime):
            params["since"] = params["since"].isoformat()
        if "masked" in params:
            params["masked"] = "true" if params["masked"] else "false"
        items: list[dict[str, Any]] = []
        cursor: str | None = None
        while len(items) < limit:
            query = {**params, "limit": min(1000, limit - len(items))}
            if cursor:
                query["cursor"] = cursor
            page = await self._get("/rollouts", query)
            items.extend(page["items"])
            cursor = page.get("next_cursor")
            if not cursor:
                break
        return items[:limit]

    async def show(self, rollout_id: str) -> dict[str, Any]:
        detail: dict[str, Any] = await self._get(f"/rollouts/{rollout_id}")
        return detail

    async def stats(self, since: datetime | None) -> dict[str, Any]:
        stats: dict[str, Any] = await self._get(
            "/stats", {"since": since.isoformat()} if since else None
        )
        return stats

    async def close(self) -> None:
        await self._http.aclose()


def _summary_dict(item: Any) -> dict[str, Any]:
    return {
        "rollout_id": item.rollout_id,
        "state": item.state,
        "incomplete": item.incomplete,
        "version": item.version,
        "n_calls": item.n_calls,
        "created_at": item.created_at,
        "updated_at": item.updated_at,
        "outcome": item.outcome,
        "mask_reasons": list(item.mask_reasons),
        "incomplete_reasons": list(item.incomplete_reasons),
        "delivered_fraction": item.delivered_fraction,
        "chains": item.chains,
    }


def _audit_source(db: str, token: str | None) -> Any:
    if db.startswith(("http://", "https://")):
        return _RemoteAudit(db, token)
    return _LocalAudit(db)


def _run(db: str, token: str | None, body: Any) -> Any:
    from ledger.cli_db import check_db_url

    check_db_url(db, allow_http=True)

    async def main() -> Any:
        source = _audit_source(db, token)
        try:
            return await body(source)
        finally:
            await source.close()

    return asyncio.run(main())


# Reasons a rollout can carry even when no rollout in the ledger has it yet.
_OTHER_REASONS = (
    "source_error",
    "no_capture_key",
    "malformed_rollout_id",
    "upstream_error",
    "missing_token_ids",
    "malformed_token_payload",
    "capture_failed",
    "unrecognized_route",
    "dangling_intent",
)


async def _check_reason(source: Any, reason: str | None) -> None:
    """``--reason`` must name a reason the ledger knows; otherwise say which ones exist."""
    if reason is None:
        return
    from ledger.builder import MASK_REASONS

    stats = await source.stats(None)
    known = set(MASK_REASONS) | set(_OTHER_REASONS)
    known |= set(stats.get("mask_reasons") or {}) | set(
        stats.get("incomplete_events_by_reason") or {}
    )
    if reason not in known:
        fail(f"unknown reason {reason!r}: use one of {', '.join(sorted(known))}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return ts(value)
    if isinstance(value, dict):
        return {
            k: ts(v) if k.endswith("_at") and isinstance(v, str) and v else _jsonable(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def _reasons_cell(item: dict[str, Any]) -> str:
    reasons = list(item.get("mask_reasons") or [])
    causes = list(item.get("incomplete_reasons") or [])
    cells = []
    for r in reasons:
        cells.append(f"{r} ({', '.join(causes)})" if r == "capture_incomplete" and causes else r)
    return ", ".join(cells)


def _rollout_table(title: str, items: list[dict[str, Any]]) -> Table:
    t = _table(
        title,
        ("rollout", "state", "calls", "chains", "delivered", "outcome", "reasons", "updated"),
    )
    for i in items:
        frac = i.get("delivered_fraction")
        t.add_row(
            i["rollout_id"],
            i["state"],
            str(i["n_calls"]),
            str(i.get("chains") or ""),
            "" if frac is None else f"{frac:.2f}",
            i.get("outcome") or "",
            _reasons_cell(i),
            ts(i.get("updated_at")),
        )
    return t


def _list_rollouts(
    title: str,
    db: str,
    token: str | None,
    filters: dict[str, Any],
    *,
    wide: bool,
    as_json: bool,
) -> None:
    """Print the rollouts ``source.list(**filters)`` finds, as a table or as JSON: ``since``
    is parsed first, and a ``reason`` is checked against the known reasons."""
    filters = {**filters, "since": parse_since(filters["since"])}

    async def body(source: Any) -> list[dict[str, Any]]:
        await _check_reason(source, filters["reason"])
        items: list[dict[str, Any]] = await source.list(**filters)
        return items

    items = _run(db, token, body)
    if as_json:
        print(json.dumps(_jsonable(items), indent=2))
        return
    _stdout(wide).print(_rollout_table(f"{title} ({len(items)})", items))


# --------------------------------------------------------------------------- commands


def audit_list(
    db: DbOption = DEFAULT_DB_URL,
    token: TokenOption = None,
    state: Annotated[
        str | None, typer.Option(help="Only this state: open, frozen or retired.")
    ] = None,
    outcome: Annotated[
        str | None, typer.Option(help="Only this latest build: delivered, masked or failed.")
    ] = None,
    reason: Annotated[
        str | None,
        typer.Option(help="Only rollouts with this mask reason or incomplete cause."),
    ] = None,
    since: SinceOption = None,
    limit: LimitOption = 100,
    wide: WideFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Rollouts, filtered by state, outcome, reason and time."""
    if state is not None and state not in ("open", "frozen", "retired"):
        fail(f"--state must be open, frozen or retired; got {state!r}")
    if outcome is not None and outcome not in ("delivered", "masked", "failed"):
        fail(f"--outcome must be delivered, masked or failed; got {outcome!r}")
    filters = {"state": state, "outcome": outcome, "reason": reason, "since": since, "limit": limit}
    _list_rollouts("rollouts", db, token, filters, wide=wide, as_json=as_json)


def audit_masked(
    db: DbOption = DEFAULT_DB_URL,
    token: TokenOption = None,
    reason: Annotated[
        str | None,
        typer.Option(
            help="Only this mask reason or incomplete cause (e.g. capture_incomplete, "
            "missing_token_ids)."
        ),
    ] = None,
    since: SinceOption = None,
    limit: LimitOption = 100,
    wide: WideFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Masked rollouts (latest build masked or failed), with their reasons and causes."""
    filters = {"masked": True, "reason": reason, "since": since, "limit": limit}
    _list_rollouts("masked rollouts", db, token, filters, wide=wide, as_json=as_json)


def audit_show(
    rollout_id: Annotated[str, typer.Argument(help="The rollout id.")],
    db: DbOption = DEFAULT_DB_URL,
    token: TokenOption = None,
    wide: WideFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """One rollout in full: calls, edges, quarantines, incomplete events, deliveries."""

    async def body(source: Any) -> dict[str, Any]:
        detail: dict[str, Any] = await source.show(rollout_id)
        return detail

    detail = _run(db, token, body)
    if as_json:
        print(json.dumps(_jsonable(detail), indent=2, default=str))
        return
    _print_detail(_stdout(wide), detail)


def audit_stats(
    db: DbOption = DEFAULT_DB_URL,
    token: TokenOption = None,
    since: SinceOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Counts by state, outcome and reason; mask fraction; delivered-fraction distribution."""
    when = parse_since(since)

    async def body(source: Any) -> dict[str, Any]:
        stats: dict[str, Any] = await source.stats(when)
        return stats

    stats = _run(db, token, body)
    if as_json:
        print(json.dumps(stats, indent=2))
        return
    t = Table(title="ledger statistics", title_justify="left")
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
            if n:  # a histogram's empty buckets say nothing
                t.add_row(f"{section}: {key}", str(n))
    mf = stats["mask_fraction"]
    t.add_row("mask fraction", "n/a" if mf is None else f"{mf:.1%}")
    _stdout(True).print(t)


def audit_app() -> typer.Typer:
    """The ``audit`` sub-app: its commands, in the order ``--help`` lists them."""
    sub = typer.Typer(
        help="Why were rollouts masked? Read the ledger (never changes it).",
        no_args_is_help=True,
    )
    sub.command("list")(audit_list)
    sub.command("masked")(audit_masked)
    sub.command("show")(audit_show)
    sub.command("stats")(audit_stats)
    return sub


def _cell(value: Any, key: str = "") -> str:
    if value is None:
        return ""
    if key.endswith("_at"):
        return ts(value)
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _print_detail(out: Console, detail: dict[str, Any]) -> None:
    r = detail["rollout"]
    out.print(
        f"[bold]{r['rollout_id']}[/] state={r['state']} incomplete={r['incomplete']} "
        f"version={r['version']} snapshot={r['snapshot_id']} updated={ts(r.get('updated_at'))}"
    )
    calls = _table(
        "calls", ("call", "status", "prompt", "gen", "cumulative", "parent", "delta", "tokens")
    )
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
    edges = _table(
        "lineage edges", ("child", "parent", "method", "status", "shared", "first mismatch")
    )
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
            ("model_call_id", "reason", "detail", "created_at"),
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
                "built_at",
                "durable_ack_at",
                "retired_at",
            ),
        ),
    ):
        t = _table(title, cols)
        for row in rows:
            t.add_row(*(_cell(row.get(col), col) for col in cols))
        out.print(t)
