"""Read-only audit queries (why was a rollout masked, what did a run look like)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from ledger.errors import (
    NotFound,
)
from ledger.ids import validate_rollout_id
from ledger.storage.core import IE, C, D, E, LedgerCore, Q, R, T

__all__ = [
    "Audit",
    "RolloutSummary",
    "json_array_holds",
    "latest_build",
    "rollouts_with_latest_build",
]


@dataclass(frozen=True, slots=True)
class RolloutSummary:
    rollout_id: str
    state: str
    incomplete: bool
    version: int
    n_calls: int
    created_at: datetime
    updated_at: datetime
    outcome: str | None
    mask_reasons: list[str]
    delivered_fraction: float | None
    chains: int | None
    # The causes behind ``capture_incomplete`` (``upstream_error``, ``missing_token_ids``, …).
    incomplete_reasons: tuple[str, ...] = ()


class Audit:
    """Read-only audit queries (why was a rollout masked, what did a run look like)."""

    def __init__(self, ledger: LedgerCore) -> None:
        self.ledger = ledger

    def _latest_delivery(self) -> Any:
        return latest_build()

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
        q = rollouts_with_latest_build(D.c.metrics).order_by(R.c.rollout_id)
        if state:
            q = q.where(R.c.state == state)
        if outcome:
            q = q.where(D.c.outcome == outcome)
        if masked is True:
            q = q.where(D.c.outcome.in_(("masked", "failed")))
        elif masked is False:
            q = q.where(D.c.outcome == "delivered")
        if reason:
            q = q.where(_names_reason(self.ledger.dialect, reason))
        if since is not None:
            q = q.where(R.c.updated_at >= since)
        if cursor:
            q = q.where(R.c.rollout_id > cursor)
        q = q.limit(max(1, limit) + 1)
        out: list[RolloutSummary] = []
        batch = max(1, min(limit, 1000))
        async with self.ledger._read() as conn:
            result = await conn.stream(q.execution_options(yield_per=batch))
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
            head = (
                await conn.execute(sa.select(R).where(R.c.rollout_id == rollout_id))
            ).one_or_none()
            if head is None:
                raise NotFound(f"no rollout {rollout_id!r} in the ledger", rollout_id=rollout_id)
            calls = (
                await conn.execute(
                    sa.select(
                        C.c.id,
                        C.c.model_call_id,
                        C.c.status,
                        C.c.model,
                        C.c.route,
                        C.c.response_id,
                        C.c.prompt_len,
                        C.c.generation_len,
                        C.c.cumulative_len,
                        C.c.parent_call_id,
                        C.c.prompt_is_delta,
                        C.c.created_at,
                        C.c.registered_at,
                        C.c.recorded_at,
                        sa.exists().where(T.c.call_id == C.c.id).label("has_tokens"),
                    )
                    .where(C.c.rollout_id == rollout_id)
                    .order_by(C.c.id)
                )
            ).all()
            parent = C.alias("parent")
            child = C.alias("child")
            edges = (
                await conn.execute(
                    sa.select(
                        child.c.model_call_id.label("child"),
                        parent.c.model_call_id.label("parent"),
                        E.c.method,
                        E.c.status,
                        E.c.shared_len,
                        E.c.mismatch_pos,
                        E.c.mismatch_kind,
                    )
                    .join(child, child.c.id == E.c.child_id)
                    .join(parent, parent.c.id == E.c.parent_id)
                    .where(E.c.rollout_id == rollout_id)
                    .order_by(E.c.id)
                )
            ).all()
            quarantines = (
                await conn.execute(
                    sa.select(
                        Q.c.delivery_id, Q.c.model_call_id, Q.c.reason, Q.c.detail, Q.c.created_at
                    )
                    .where(Q.c.rollout_id == rollout_id)
                    .order_by(Q.c.id)
                )
            ).all()
            events = (
                await conn.execute(
                    sa.select(IE.c.model_call_id, IE.c.reason, IE.c.detail, IE.c.created_at)
                    .where(IE.c.rollout_id == rollout_id)
                    .order_by(IE.c.id)
                )
            ).all()
            deliveries = (
                await conn.execute(
                    sa.select(D).where(D.c.rollout_id == rollout_id).order_by(D.c.id)
                )
            ).all()
        return {
            "rollout": _row_dict(head),
            "calls": [_row_dict(c, drop=("id",)) for c in calls],
            "edges": [_row_dict(e) for e in edges],
            "quarantines": [_row_dict(q) for q in quarantines],
            "incomplete_events": [_row_dict(e) for e in events],
            "deliveries": [_row_dict(d) for d in deliveries],
        }

    async def stats(self, *, since: datetime | None = None) -> dict[str, Any]:
        """Counts by state, outcome and reason; mask fraction; delivered-fraction histogram."""
        latest = self._latest_delivery()
        async with self.ledger._read() as conn:
            sq = sa.select(R.c.state, sa.func.count()).group_by(R.c.state)
            if since is not None:
                sq = sq.where(R.c.updated_at >= since)
            states = {s: n for s, n in (await conn.execute(sq)).all()}
            dq = sa.select(D.c.outcome, D.c.mask_reasons, D.c.metrics).join(
                latest, latest.c.did == D.c.id
            )
            if since is not None:
                dq = dq.where(D.c.built_at >= since)
            outcomes: dict[str, int] = {}
            reasons: dict[str, int] = {}
            buckets = [0] * 11
            chains: dict[str, int] = {}
            result = await conn.stream(dq.execution_options(yield_per=1000))
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
            events: dict[str, int] = {
                reason: n
                for reason, n in (
                    await conn.execute(
                        sa.select(IE.c.reason, sa.func.count()).group_by(IE.c.reason)
                    )
                ).all()
            }
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


def json_array_holds(dialect: str, column: Any, value: str, path: str | None = None) -> Any:
    """The JSON array in ``column`` (at ``path``, e.g. ``$.incomplete_reasons``) holds ``value``
    as an element: an exact match, in SQL, on both dialects."""
    if dialect == "postgresql":
        array: Any = sa.cast(column, JSONB)
        if path is not None:
            array = array[path.removeprefix("$.")]
        return array.has_key(value)
    args = (column,) if path is None else (column, path)
    elements = sa.func.json_each(*args).table_valued("value").alias("element")
    return sa.exists().select_from(elements).where(elements.c.value == value)


def _names_reason(dialect: str, reason: str) -> Any:
    """The latest delivery names ``reason`` among its mask reasons or among the causes behind
    ``capture_incomplete`` (``metrics.incomplete_reasons``): an exact element match, in SQL."""
    return sa.or_(
        json_array_holds(dialect, D.c.mask_reasons, reason),
        json_array_holds(dialect, D.c.metrics, reason, "$.incomplete_reasons"),
    )


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


def latest_build(since: datetime | None = None) -> Any:
    """Each rollout's latest build (its highest delivery id), among builds since ``since`` when
    given: a subquery of ``rollout_id`` and ``did``."""
    q = sa.select(D.c.rollout_id, sa.func.max(D.c.id).label("did"))
    if since is not None:
        q = q.where(D.c.built_at >= since)
    return q.group_by(D.c.rollout_id).subquery("latest")


def rollouts_with_latest_build(*columns: Any) -> Any:
    """Every rollout with its captured-call count, its latest build's outcome and mask reasons,
    and that build's ``columns`` (NULL for a rollout never built): the audit listings' base."""
    latest = latest_build()
    n_calls = (
        sa.select(sa.func.count())
        .where(C.c.rollout_id == R.c.rollout_id, C.c.status == "captured")
        .scalar_subquery()
    )
    return sa.select(
        R.c.rollout_id,
        R.c.state,
        R.c.incomplete,
        R.c.version,
        R.c.created_at,
        R.c.updated_at,
        n_calls.label("n_calls"),
        D.c.outcome,
        D.c.mask_reasons,
        *columns,
    ).select_from(
        R.outerjoin(latest, latest.c.rollout_id == R.c.rollout_id).outerjoin(
            D, D.c.id == latest.c.did
        )
    )
