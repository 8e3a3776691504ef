"""Trainer routes (``trainer`` scope): freeze, finalize, retire, delivery acks."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import Path, Request, Response

from api.errors import error_response
from api.limits import encode_entries_off_loop
from api.routes.common import LedgerDep, RolloutId, ledger_router
from api.schemas import (
    AckBody,
    FinalizeBody,
    FinalizeOut,
    RetireBody,
    RetireOut,
    SnapshotOut,
)
from ledger.errors import NotFound, RolloutRetired, StaleSnapshot
from ledger.wire import TokenEncoding, finite_json

log = logging.getLogger("rollout_ledger.api.ledger")

router = ledger_router("trainer")


@router.post("/rollouts/{rollout_id}/freeze", response_model=SnapshotOut)
async def freeze(
    rollout_id: RolloutId,
    led: LedgerDep,
    request: Request,
    token_encoding: TokenEncoding = "json",
) -> SnapshotOut:
    """Freeze (idempotent) and return full-prompt entries from one consistent read."""
    snap = await led.freeze(rollout_id)
    request.app.state.metrics.freezes.inc()
    log.info(
        "froze rollout=%s snapshot=%s version=%d calls=%d incomplete=%s",
        rollout_id,
        snap.snapshot_id,
        snap.version,
        len(snap.entries),
        snap.incomplete,
        extra={"rollout_id": rollout_id, "snapshot_id": snap.snapshot_id},
    )
    return SnapshotOut(
        rollout_id=snap.rollout_id,
        entries=await encode_entries_off_loop(snap.entries, token_encoding),
        incomplete=snap.incomplete,
        snapshot_id=snap.snapshot_id,
        version=snap.version,
        token_encoding=token_encoding,
    )


@router.post("/finalize", response_model=FinalizeOut)
async def finalize(body: FinalizeBody, led: LedgerDep, request: Request) -> FinalizeOut:
    """Rebuild one rollout result: freeze, build, project, mask; returns result and build."""
    from ledger.delivery import finalize

    result = body.result
    build = await finalize(result, led, deliver=body.deliver, consumer=body.consumer)
    metrics = request.app.state.metrics
    metrics.builds.labels(build.outcome).inc()
    for reason in build.mask_reasons:
        metrics.masked.labels(reason).inc()
    # The rebuilt response travels in the result, so the answer's build leaves it out.
    wire = build.to_wire(with_response=False)
    return FinalizeOut(result=finite_json(result), build=finite_json(wire))


@router.post(
    "/rollouts/{rollout_id}/retire",
    response_model=RetireOut,
    responses={
        200: {
            "model": RetireOut,
            "description": "Retired (or already retired at exactly this "
            "snapshot identity: a safe repeat).",
        },
        404: error_response("No such rollout."),
        409: error_response("Not frozen at that snapshot identity: nothing retired."),
        410: error_response("Already retired at another snapshot identity."),
    },
)
async def retire(
    rollout_id: RolloutId, body: RetireBody, led: LedgerDep, request: Request
) -> RetireOut:
    """Retire exactly the consumed snapshot; 409 if anything changed since.

    Repeating a retire that succeeded (a client retrying after a lost answer) answers 200.
    """
    metrics = request.app.state.metrics
    ids = {"rollout_id": rollout_id, "snapshot_id": body.snapshot_id}
    # The rule (retired, repeat, stale, retired elsewhere, unknown) is the ledger's, decided in
    # one transaction; this handler only maps its answer.
    outcome = await led.retire_outcome(
        rollout_id, snapshot_id=body.snapshot_id, version=body.version
    )
    label = "stale" if outcome.status == "retired_elsewhere" else outcome.status
    metrics.retires.labels(label).inc()
    if outcome.status == "retired":
        log.info("retired rollout=%s snapshot=%s", rollout_id, body.snapshot_id, extra=ids)
    if outcome.retired:
        return RetireOut(retired=True)
    state = outcome.state
    if state is None:
        raise NotFound(
            f"no rollout {rollout_id!r} in the ledger: nothing to retire", rollout_id=rollout_id
        )
    asked = f"snapshot {body.snapshot_id!r} version {body.version}"
    at = f"snapshot {state.snapshot_id!r} version {state.version}"
    if outcome.status == "retired_elsewhere":
        raise RolloutRetired(
            f"rollout {rollout_id!r} was already retired at {at}, not {asked}",
            rollout_id=rollout_id,
        )
    log.info(
        "retire refused rollout=%s: asked %s, is %s at %s",
        rollout_id,
        asked,
        state.state,
        at,
        extra=ids,
    )
    if state.state == "open":
        detail = "it is open (not frozen): freeze it and build from that snapshot first"
    else:
        detail = f"it is frozen at {at}; something changed since the snapshot was taken"
    raise StaleSnapshot(
        f"rollout {rollout_id!r} is not frozen at {asked}: {detail}; nothing was retired",
        rollout_id=rollout_id,
    )


@router.post("/deliveries/{delivery_id}/ack", status_code=204)
async def ack_delivery(
    delivery_id: Annotated[int, Path(ge=1, le=2**62)], body: AckBody, led: LedgerDep
) -> Response:
    """Record that the consumer stored the delivered rollout durably."""
    await led.mark_delivery(delivery_id, durable=body.durable)
    return Response(status_code=204)
