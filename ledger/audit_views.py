"""Read-side views for the audit web page (``/ui``): run health over time, a filterable list of
rollouts, and the token window around a drifted lineage edge.

These are read-only views over the same tables as ``ledger.storage.audit.Audit`` (whose
``rollout_detail`` the page reuses); their statements are named in ``ledger.storage.queries``.
Every query here reads through the ledger's read-only connection and touches either one
rollout or an indexed time window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from ledger.errors import InvalidInput, LedgerError
from ledger.ids import validate_rollout_id
from ledger.storage import queries
from ledger.storage.audit import RolloutListing, as_utc
from ledger.store import Ledger

__all__ = [
    "OUTCOME_FILTERS",
    "AuditViews",
    "DriftWindow",
    "HealthBucket",
    "HealthReport",
    "RolloutPage",
    "RolloutRow",
]


# ``none``: never built.  ``masked`` covers failed builds too (both are masked from the loss).
OUTCOME_FILTERS = ("delivered", "masked", "failed", "none")
MAX_BUCKETS = 500


@dataclass
class HealthBucket:
    """What happened in one time bucket (builds counted by their latest build per rollout)."""

    start: datetime
    calls_captured: int = 0
    rollouts_started: int = 0
    delivered: int = 0
    masked: int = 0
    failed: int = 0
    masked_by_reason: dict[str, int] = field(default_factory=dict)


@dataclass
class HealthReport:
    since: datetime
    until: datetime
    bucket_s: int
    buckets: list[HealthBucket]
    totals: HealthBucket
    incomplete_by_reason: dict[str, int]
    consumers: list[str]


@dataclass(frozen=True, slots=True)
class RolloutRow(RolloutListing):
    """A rollout as the audit page lists it: with its incomplete causes and its latest build's
    consumer and time (times in aware UTC)."""

    causes: list[str]
    consumer: str | None
    built_at: datetime | None


@dataclass(frozen=True, slots=True)
class RolloutPage:
    items: list[RolloutRow]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class DriftWindow:
    """The tokens on both sides of a drifted edge's first mismatch.

    ``shared`` are the last tokens both sequences agree on (ending at ``position``);
    ``parent_next`` continues the parent's prompt + generation from ``position``, and
    ``child_next`` the child's prompt.  ``unavailable`` says why there are no tokens (the
    rollout was retired and its payloads deleted, or a record cannot be reconstructed).
    """

    child: str
    parent: str
    position: int
    kind: str | None
    shared_start: int = 0
    shared: list[int] = field(default_factory=list)
    parent_next: list[int] = field(default_factory=list)
    child_next: list[int] = field(default_factory=list)
    unavailable: str | None = None


class AuditViews:
    """Read-only queries behind the audit page."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    # ------------------------------------------------------------------ time buckets

    async def health(
        self, *, since: datetime, until: datetime | None = None, buckets: int = 48
    ) -> HealthReport:
        """Calls captured, rollouts started and latest builds (by outcome and mask reason) per
        time bucket between ``since`` and ``until``."""
        since = as_utc(since)
        until = as_utc(until) if until is not None else datetime.now(UTC)
        if until <= since:
            raise InvalidInput("the health window must end after it starts (until > since)")
        n = max(1, min(buckets, MAX_BUCKETS))
        bucket_s = max(1, math.ceil((until - since).total_seconds() / n))
        # Buckets start on whole multiples of bucket_s (epoch seconds), so every time in
        # [since, until] falls in one, whole seconds included (the SQL truncates to seconds).
        grid = math.floor(since.timestamp() / bucket_s) * bucket_s
        first = datetime.fromtimestamp(grid, UTC)
        n = math.floor((until.timestamp() - grid) / bucket_s) + 1
        out = [HealthBucket(first + timedelta(seconds=i * bucket_s)) for i in range(n)]
        totals = HealthBucket(first)

        def slot(index: Any) -> HealthBucket | None:
            i = int(index)
            return out[i] if 0 <= i < n else None

        sql = self.ledger.sql
        calls_q = queries.captured_per_bucket(sql, first, bucket_s, since, until)
        roll_q = queries.started_per_bucket(sql, first, bucket_s, since, until)
        build_q = queries.builds_per_bucket(sql, first, bucket_s, since, until)
        events_q = queries.incomplete_events_by_reason((since, until))
        consumers: set[str] = set()
        async with self.ledger._read() as conn:
            for b, count in (await conn.execute(calls_q)).all():
                if (s := slot(b)) is not None:
                    s.calls_captured += count
                    totals.calls_captured += count
            for b, count in (await conn.execute(roll_q)).all():
                if (s := slot(b)) is not None:
                    s.rollouts_started += count
                    totals.rollouts_started += count
            for b, outcome, reasons, consumer, count in (await conn.execute(build_q)).all():
                if consumer:
                    consumers.add(consumer)
                if (s := slot(b)) is None:
                    continue
                for target in (s, totals):
                    setattr(target, outcome, getattr(target, outcome) + count)
                    if outcome != "delivered":
                        for reason in reasons or []:
                            by = target.masked_by_reason
                            by[reason] = by.get(reason, 0) + count
            events = {r: c for r, c in (await conn.execute(events_q)).all()}
        return HealthReport(
            since=since,
            until=until,
            bucket_s=bucket_s,
            buckets=out,
            totals=totals,
            incomplete_by_reason=dict(sorted(events.items(), key=lambda kv: -kv[1])),
            consumers=sorted(consumers),
        )

    # ------------------------------------------------------------------ rollout list

    async def rollouts(
        self,
        *,
        state: str | None = None,
        outcome: str | None = None,
        reason: str | None = None,
        consumer: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        id_prefix: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> RolloutPage:
        """Rollouts, most recently changed first, filtered by state, latest build outcome, a
        reason (mask reason, incomplete cause or quarantine reason), consumer and time."""
        limit = max(1, min(limit, 500))
        query = queries.page_rollouts(
            self.ledger.sql,
            state=state,
            outcome=outcome,
            reason=reason,
            consumer=consumer,
            since=as_utc(since) if since is not None else None,
            until=as_utc(until) if until is not None else None,
            id_prefix=id_prefix,
            before=_parse_cursor(cursor) if cursor else None,
            limit=limit + 1,
        )
        async with self.ledger._read() as conn:
            rows = (await conn.execute(query)).all()
            ids = [r.rollout_id for r in rows[:limit]]
            causes: dict[str, list[str]] = {}
            if ids:
                found = await conn.execute(queries.incomplete_causes(ids))
                for rid_, cause in found.all():
                    causes.setdefault(rid_, []).append(cause)
        items = [
            RolloutRow(
                rollout_id=r.rollout_id,
                state=r.state,
                incomplete=bool(r.incomplete),
                version=r.version,
                n_calls=r.n_calls,
                created_at=as_utc(r.created_at),
                updated_at=as_utc(r.updated_at),
                outcome=r.outcome,
                mask_reasons=list(r.mask_reasons or []),
                causes=causes.get(r.rollout_id, []),
                consumer=r.consumer,
                built_at=as_utc(r.built_at) if r.built_at is not None else None,
            )
            for r in rows[:limit]
        ]
        next_cursor = None
        if len(rows) > limit:
            last = items[-1]
            next_cursor = f"{last.updated_at.isoformat()}|{last.rollout_id}"
        return RolloutPage(items, next_cursor)

    # ------------------------------------------------------------------ drift

    async def drift_windows(
        self, rollout_id: str, edges: Sequence[dict[str, Any]], *, context: int = 12
    ) -> list[DriftWindow]:
        """For each drifted edge (as ``Audit.rollout_detail`` lists them), the ``context``
        tokens before the first mismatch and after it on the parent's and the child's side."""
        validate_rollout_id(rollout_id)
        out: list[DriftWindow] = []
        for edge in edges:
            if edge.get("status") != "drifted" or edge.get("mismatch_pos") is None:
                continue
            pos = int(edge["mismatch_pos"])
            base = DriftWindow(edge["child"], edge["parent"], pos, edge.get("mismatch_kind"))
            try:
                parent_seq = await self._cumulative(rollout_id, edge["parent"])
                child_prompt = await self._prompt(rollout_id, edge["child"])
            except LedgerError as exc:
                out.append(_unavailable(base, exc.message))
                continue
            start = max(0, pos - context)
            out.append(
                DriftWindow(
                    base.child,
                    base.parent,
                    pos,
                    base.kind,
                    shared_start=start,
                    shared=child_prompt[start:pos],
                    parent_next=parent_seq[pos : pos + context],
                    child_next=child_prompt[pos : pos + context],
                )
            )
        return out

    async def _cumulative(self, rollout_id: str, call_id: str) -> list[int]:
        """A call's prompt followed by its generation, rebuilt by the ledger's chain walk."""
        seq: list[int] = []
        for link in await self.ledger.load_chain(rollout_id, call_id):
            seq += link.prompt_suffix
            seq += link.generation_token_ids
        return seq

    async def _prompt(self, rollout_id: str, call_id: str) -> list[int]:
        links = await self.ledger.load_chain(rollout_id, call_id)
        seq: list[int] = []
        for link in links[:-1]:
            seq += link.prompt_suffix
            seq += link.generation_token_ids
        return seq + links[-1].prompt_suffix


def _unavailable(base: DriftWindow, why: str) -> DriftWindow:
    return DriftWindow(base.child, base.parent, base.position, base.kind, unavailable=why)


def _parse_cursor(cursor: str) -> tuple[datetime, str]:
    at, sep, rid = cursor.rpartition("|")
    try:
        if not sep or not rid:
            raise ValueError(cursor)
        return as_utc(datetime.fromisoformat(at)), rid
    except ValueError:
        raise InvalidInput(
            f"cursor {cursor!r} is not a next_cursor this API returned; start without one"
        ) from None
