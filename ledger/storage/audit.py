"""Read-only audit queries (why was a rollout masked, what did a run look like)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ledger.errors import (
    NotFound,
)
from ledger.ids import validate_rollout_id
from ledger.storage import queries
from ledger.storage.core import LedgerCore

__all__ = ["Audit", "RolloutListing", "RolloutSummary", "as_utc"]


@dataclass(frozen=True, slots=True)
class RolloutListing:
    """What every audit listing shows of a rollout (``queries.rollouts_with_latest_build``):
    its row, its captured-call count and its latest build's outcome and mask reasons."""

    rollout_id: str
    state: str
    incomplete: bool
    version: int
    n_calls: int
    created_at: datetime
    updated_at: datetime
    outcome: str | None
    mask_reasons: list[str]


@dataclass(frozen=True, slots=True)
class RolloutSummary(RolloutListing):
    """A rollout as the audit API lists it: with its latest build's metrics."""

    delivered_fraction: float | None
    chains: int | None
    # The causes behind ``capture_incomplete`` (``upstream_error``, ``missing_token_ids``, …).
    incomplete_reasons: tuple[str, ...] = ()


class Audit:
    """Read-only audit queries (why was a rollout masked, what did a run look like)."""

    def __init__(self, ledger: LedgerCore) -> None:
        self.ledger = ledger

    async def list_rollouts(
        self,
        *,
        state: str | None = None,
        outcome: str | None = None,
        masked: bool | None = None,
        reason: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> tuple[list[RolloutSummary], str | None]:
        """Rollouts ordered by id, filtered; returns a page and the cursor of the next one.

        ``reason`` matches a mask reason or an incomplete-event reason (the cause behind
        ``capture_incomplete``).
        """
        query = queries.audit_rollouts(
            self.ledger.sql,
            state=state,
            outcome=outcome,
            masked=masked,
            reason=reason,
            since=since,
            after_id=cursor,
            limit=max(1, limit) + 1,
        )
        out: list[RolloutSummary] = []
        batch = max(1, min(limit, 1000))
        async with self.ledger._read() as conn:
            result = await conn.stream(query.execution_options(yield_per=batch))
            async for r in result:
                reasons = list(r.mask_reasons or [])
                metrics = r.metrics or {}
                causes = tuple(str(c) for c in metrics.get("incomplete_reasons") or ())
                out.append(
                    RolloutSummary(
                        r.rollout_id,
                        r.state,
                        r.incomplete,
                        r.version,
                        r.n_calls,
                        r.created_at,
                        r.updated_at,
                        r.outcome,
                        reasons,
                        metrics.get("delivered_fraction"),
                        metrics.get("chains"),
                        causes,
                    )
                )
                if len(out) > limit:
                    break
            await result.close()
        next_cursor = out[limit - 1].rollout_id if len(out) > limit else None
        return out[:limit], next_cursor

    async def rollout_detail(self, rollout_id: str) -> dict[str, Any]:
        """Everything about one rollout: calls, edges, quarantines, incomplete events, builds."""
        validate_rollout_id(rollout_id)
        async with self.ledger._read() as conn:
            head = (await conn.execute(queries.rollout_row(rollout_id))).one_or_none()
            if head is None:
                raise NotFound(f"no rollout {rollout_id!r} in the ledger", rollout_id=rollout_id)
            calls = (await conn.execute(queries.rollout_calls(rollout_id))).all()
            edges = (await conn.execute(queries.rollout_edges(rollout_id))).all()
            quarantines = (await conn.execute(queries.rollout_quarantines(rollout_id))).all()
            events = (await conn.execute(queries.rollout_incomplete_events(rollout_id))).all()
            deliveries = (await conn.execute(queries.rollout_deliveries(rollout_id))).all()
        return {
            "rollout": _row_dict(head),
            "calls": [_row_dict(c, drop=("id",)) for c in calls],
            "edges": [_row_dict(e) for e in edges],
            "quarantines": [_row_dict(row) for row in quarantines],
            "incomplete_events": [_row_dict(e) for e in events],
            "deliveries": [_row_dict(d) for d in deliveries],
        }

    async def stats(self, *, since: datetime | None = None) -> dict[str, Any]:
        """Counts by state, outcome and reason; mask fraction; delivered-fraction histogram."""
        async with self.ledger._read() as conn:
            states = {s: n for s, n in (await conn.execute(queries.rollouts_by_state(since))).all()}
            outcomes: dict[str, int] = {}
            reasons: dict[str, int] = {}
            buckets = [0] * 11
            chains: dict[str, int] = {}
            builds = queries.latest_builds(since).execution_options(yield_per=1000)
            result = await conn.stream(builds)
            async for outcome, mask_reasons, metrics in result:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                for r in mask_reasons or []:
                    reasons[r] = reasons.get(r, 0) + 1
                metrics = metrics or {}
                frac = metrics.get("delivered_fraction")
                if isinstance(frac, int | float):
                    buckets[min(10, max(0, int(frac * 10)))] += 1
                n = metrics.get("chains")
                if isinstance(n, int):
                    key = str(n) if n < 5 else "5+"
                    chains[key] = chains.get(key, 0) + 1
            by_reason = await conn.execute(queries.incomplete_events_by_reason())
            events: dict[str, int] = {reason: n for reason, n in by_reason.all()}
        built = sum(outcomes.values())
        masked = outcomes.get("masked", 0) + outcomes.get("failed", 0)
        return {
            "rollouts_by_state": states,
            "builds_by_outcome": outcomes,
            "mask_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
            "incomplete_events_by_reason": events,
            "mask_fraction": round(masked / built, 4) if built else None,
            "delivered_fraction_histogram": {
                f"{i / 10:.1f}" + ("" if i == 10 else f"-{(i + 1) / 10:.1f}"): n
                for i, n in enumerate(buckets)
            },
            "chains_histogram": chains,
        }


def _row_dict(row: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row._mapping.items():
        if key in drop:
            continue
        if isinstance(value, datetime):
            # SQLite returns naive datetimes; every stored time is UTC.
            value = (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
        out[key] = value
    return out


def as_utc(value: datetime) -> datetime:
    """``value`` as an aware UTC time; one without an offset is taken as UTC (SQLite hands back
    naive datetimes, and every stored time is UTC)."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
