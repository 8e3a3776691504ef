"""Audit routes (``audit`` scope): list rollouts, one rollout in full, stats."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Query

from api.routes.common import LedgerDep, RolloutId, ledger_router
from api.schemas import ID_PATTERN, REASON_PATTERN, RolloutItem, RolloutPage
from ledger.ids import MAX_ROLLOUT_ID_LEN
from ledger.storage.audit import as_utc
from ledger.store import Audit

router = ledger_router("audit")


def _since_utc(value: datetime | None) -> datetime | None:
    """``since=`` in UTC: SQLite compares stored UTC wall-clock text, so an offset must be
    applied here (a value without one is taken as UTC)."""
    return None if value is None else as_utc(value)


@router.get("/rollouts", response_model=RolloutPage)
async def list_rollouts(
    led: LedgerDep,
    state: Literal["open", "frozen", "retired"] | None = None,
    outcome: Literal["delivered", "masked", "failed"] | None = None,
    masked: bool | None = None,
    reason: Annotated[str | None, Query(max_length=64, pattern=REASON_PATTERN)] = None,
    since: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[
        str | None,
        Query(
            max_length=MAX_ROLLOUT_ID_LEN,
            pattern=ID_PATTERN,
            description="next_cursor of the previous page.",
        ),
    ] = None,
) -> RolloutPage:
    """Rollouts with filters, ordered by id, with cursor pagination."""
    items, nxt = await Audit(led).list_rollouts(
        state=state,
        outcome=outcome,
        masked=masked,
        reason=reason,
        since=_since_utc(since),
        limit=limit,
        cursor=cursor,
    )
    return RolloutPage(
        items=[RolloutItem.model_validate(i, from_attributes=True) for i in items],
        next_cursor=nxt,
    )


@router.get("/rollouts/{rollout_id}")
async def show_rollout(rollout_id: RolloutId, led: LedgerDep) -> dict[str, Any]:
    """One rollout in full: calls, edges, quarantines, incomplete events, deliveries."""
    return await Audit(led).rollout_detail(rollout_id)


@router.get("/stats")
async def stats(led: LedgerDep, since: datetime | None = None) -> dict[str, Any]:
    """Counts by state, outcome and reason; mask fraction; delivered-fraction distribution."""
    return await Audit(led).stats(since=_since_utc(since))
