"""Ingest routes (``ingest`` scope): intents, call records, incomplete marks, lineage, custody."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Request, Response

from api.limits import check_record_tokens
from api.metrics import incomplete_label
from api.routes.common import CallId, LedgerDep, RolloutId, ledger_router
from api.schemas import (
    CancelOut,
    CustodyFailureBody,
    CustodyRecordBody,
    CustodyRecordOut,
    HasRowsOut,
    IncompleteBody,
    IntentBody,
    IntentOut,
    PutBody,
    PutOut,
    ResolveBody,
    ResolveOut,
    ResolveRequestBody,
    ResolveRequestOut,
    VersionOut,
)
from ledger.errors import InvalidInput, PayloadConflict
from ledger.records import coerce_entry
from ledger.wire import decode_record, pack_b64_ids, unpack_b64_ids

log = logging.getLogger("rollout_ledger.api.ledger")

router = ledger_router("ingest")


@router.post(
    "/rollouts/{rollout_id}/calls/{model_call_id}/intent",
    response_model=IntentOut,
    status_code=201,
    responses={200: {"model": IntentOut, "description": "Already registered."}},
)
async def begin_call(
    rollout_id: RolloutId,
    model_call_id: CallId,
    body: IntentBody,
    led: LedgerDep,
    response: Response,
) -> IntentOut:
    """Record a pre-dispatch intent; an intent without a record at freeze masks the rollout."""
    created = await led.begin_call(rollout_id, model_call_id, route=body.route, model=body.model)
    if not created:
        response.status_code = 200
    return IntentOut(created=created)


@router.post("/rollouts/{rollout_id}/calls/{model_call_id}/cancel", response_model=CancelOut)
async def cancel_call(rollout_id: RolloutId, model_call_id: CallId, led: LedgerDep) -> CancelOut:
    """Close an intent for a call that ended without generating."""
    return CancelOut(cancelled=await led.cancel_call(rollout_id, model_call_id))


@router.put(
    "/rollouts/{rollout_id}/calls/{model_call_id}",
    response_model=PutOut,
    status_code=201,
    responses={
        200: {"model": PutOut, "description": "Byte-identical repeat: nothing changed."},
        409: {"description": "Different payload for this call id, or the rollout is frozen."},
        410: {"description": "The rollout is retired."},
    },
)
async def put_call(
    rollout_id: RolloutId,
    model_call_id: CallId,
    body: PutBody,
    led: LedgerDep,
    request: Request,
    response: Response,
) -> PutOut:
    """Commit one call record (with its proven lineage) before answering."""
    raw = decode_record(body.record.model_dump(), body.token_encoding)
    check_record_tokens(request, raw)
    for key, expected in (("rollout_id", rollout_id), ("model_call_id", model_call_id)):
        if raw.get(key) not in (None, expected):
            raise InvalidInput(f"record.{key} {raw[key]!r} does not match the path ({expected!r})")
        raw[key] = expected
    entry = coerce_entry(raw)
    metrics = request.app.state.metrics
    started = time.perf_counter()
    ids = {"rollout_id": rollout_id, "model_call_id": model_call_id}
    try:
        res = await led.put(
            entry,
            route=body.route,
            request_fingerprint=body.request_fingerprint,
            continuation_fingerprint=body.continuation_fingerprint,
        )
    except Exception as exc:
        metrics.ingest.labels("put", type(exc).__name__).inc()
        if isinstance(exc, PayloadConflict):
            metrics.incomplete.labels("conflicting_payload").inc()
        log.warning(
            "put refused rollout=%s call=%s: %s: %s",
            rollout_id,
            model_call_id,
            type(exc).__name__,
            exc,
            extra={**ids, "outcome": type(exc).__name__},
        )
        raise
    metrics.ingest_seconds.labels("put").observe(time.perf_counter() - started)
    metrics.ingest.labels("put", res.status).inc()
    log.info(
        "put %s rollout=%s call=%s version=%d parent=%s",
        res.status,
        rollout_id,
        model_call_id,
        res.version,
        res.parent_call_id,
        extra={**ids, "outcome": res.status, "version": res.version},
    )
    if res.status == "duplicate":
        response.status_code = 200
    return PutOut(
        status="created" if res.status == "created" else "duplicate",
        version=res.version,
        parent_call_id=res.parent_call_id,
        prompt_is_delta=res.prompt_is_delta,
        edge_method=res.edge_method,
    )


@router.post("/rollouts/{rollout_id}/incomplete", response_model=VersionOut)
async def mark_incomplete(
    rollout_id: RolloutId, body: IncompleteBody, led: LedgerDep, request: Request
) -> VersionOut:
    """Durably mark the rollout incomplete with a reason (allowed after freeze)."""
    version = await led.mark_incomplete(
        rollout_id, body.model_call_id, reason=body.reason, detail=body.detail
    )
    request.app.state.metrics.incomplete.labels(incomplete_label(body.reason)).inc()
    log.warning(
        "marked incomplete rollout=%s call=%s reason=%s",
        rollout_id,
        body.model_call_id,
        body.reason,
        extra={
            "rollout_id": rollout_id,
            "model_call_id": body.model_call_id,
            "reason": body.reason,
        },
    )
    return VersionOut(version=version)


@router.post("/rollouts/{rollout_id}/lineage/resolve", response_model=ResolveOut)
async def resolve(rollout_id: RolloutId, body: ResolveBody, led: LedgerDep) -> ResolveOut:
    """The proven parent of a candidate prompt and its exact cumulative tokens."""
    prompt = (
        unpack_b64_ids(body.prompt_token_ids, "prompt_token_ids")
        if isinstance(body.prompt_token_ids, str)
        else body.prompt_token_ids
    )
    res = await led.resolve(rollout_id, prompt)
    cumulative: list[int] | str | None = res.cumulative_token_ids
    if cumulative is not None and body.token_encoding == "packed-v1":
        cumulative = pack_b64_ids(res.cumulative_token_ids or [])
    return ResolveOut(
        status=res.status,
        model_call_id=res.model_call_id,
        cumulative_token_ids=cumulative,
        digest=res.digest,
        reason=res.reason,
        token_encoding=body.token_encoding,
    )


@router.post("/rollouts/{rollout_id}/lineage/resolve-request", response_model=ResolveRequestOut)
async def resolve_request(
    rollout_id: RolloutId, body: ResolveRequestBody, led: LedgerDep
) -> ResolveRequestOut:
    """NeMo Gym 0.7.0 lineage: which captured call a request continues (root, resolved with the
    parent's exact cumulative tokens, or unresolved with a reason)."""
    from ledger.gym_store import resolve_request as resolve_items

    data = (await resolve_items(led, rollout_id, body.request_items)).as_json()
    match = data["match"]
    if match is not None and body.token_encoding == "packed-v1":
        match["cumulative_token_ids"] = pack_b64_ids(match["cumulative_token_ids"])
    return ResolveRequestOut(**data, token_encoding=body.token_encoding)


@router.post(
    "/rollouts/{rollout_id}/custody/records",
    response_model=CustodyRecordOut,
    status_code=201,
    responses={
        200: {"model": CustodyRecordOut, "description": "Identical repeat: nothing changed."},
        409: {"description": "This call id was recorded with different data."},
    },
)
async def custody_record(
    rollout_id: RolloutId, body: CustodyRecordBody, led: LedgerDep, response: Response
) -> CustodyRecordOut:
    """NeMo Gym 0.7.0 ``CaptureLedger.record``: publish an externally staged call."""
    from ledger import custody

    if body.commit.get("rollout_id") not in (None, rollout_id):
        raise InvalidInput(f"commit.rollout_id does not match the path ({rollout_id!r})")
    created = await custody.record(led, {**body.commit, "rollout_id": rollout_id})
    if not created:
        response.status_code = 200
    return CustodyRecordOut(created=created)


@router.post("/rollouts/{rollout_id}/custody/failures", status_code=204)
async def custody_record_failure(
    rollout_id: RolloutId, body: CustodyFailureBody, led: LedgerDep
) -> Response:
    """NeMo Gym 0.7.0 ``CaptureLedger.record_failure``: a poison row for a call."""
    from ledger import custody

    await custody.record_failure(led, rollout_id, body.model_call_id, body.reason)
    return Response(status_code=204)


@router.get("/rollouts/{rollout_id}/custody/manifest")
async def custody_manifest(rollout_id: RolloutId, led: LedgerDep) -> dict[str, Any]:
    """NeMo Gym 0.7.0 ``CaptureLedger.manifest``: the token-free ``RolloutManifest``."""
    from ledger import custody

    return await custody.manifest(led, rollout_id)


@router.get("/rollouts/{rollout_id}/custody/has-rows", response_model=HasRowsOut)
async def custody_has_rows(rollout_id: RolloutId, led: LedgerDep) -> HasRowsOut:
    """NeMo Gym 0.7.0 ``CaptureLedger.has_rows``."""
    from ledger import custody

    return HasRowsOut(has_rows=await custody.has_rows(led, rollout_id))
