"""Admin routes (``admin`` scope): delete a rollout, sweep retired tombstones."""

from __future__ import annotations

from datetime import timedelta

from api.routes.common import LedgerDep, RolloutId, ledger_router
from api.schemas import DeletedOut, SweepBody, SweepOut

router = ledger_router("admin")


@router.delete("/rollouts/{rollout_id}", response_model=DeletedOut)
async def delete_rollout(rollout_id: RolloutId, led: LedgerDep) -> DeletedOut:
    """Remove every trace of a rollout before re-dispatching its id."""
    return DeletedOut(deleted=await led.delete_rollout(rollout_id))


@router.post("/admin/sweep", response_model=SweepOut)
async def sweep(body: SweepBody, led: LedgerDep) -> SweepOut:
    """Remove retired tombstones older than ``older_than_s``."""
    return SweepOut(removed=await led.sweep(timedelta(seconds=body.older_than_s)))
