"""The ledger API under ``/ledger/v1/``: ingest, trainer, admin and audit routes.

Routes are thin: parse, call one ledger operation, return its result.  Errors are mapped to
HTTP in ``api.errors``.  Token arrays travel as JSON lists by default, or with
``token_encoding: "packed-v1"`` as base64 of little-endian int32 ids and float64 log-probs
(exact for every value, ``-inf`` included).
"""

from __future__ import annotations

import base64
import time
from array import array
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from api.auth import require
from ledger import codec
from ledger.errors import InvalidInput
from ledger.ids import MAX_ROLLOUT_ID_LEN
from ledger.records import TokenEntry, coerce_entry
from ledger.store import Audit, Ledger

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
RolloutId = Annotated[
    str, Path(pattern=ID_PATTERN, max_length=MAX_ROLLOUT_ID_LEN, description="Rollout id.")
]
CallId = Annotated[str, Path(pattern=ID_PATTERN, max_length=200, description="Model call id.")]
TokenEncoding = Literal["json", "packed-v1"]

router = APIRouter(prefix="/ledger/v1")


def ledger_of(request: Request) -> Ledger:
    led: Ledger = request.app.state.ledger
    return led


LedgerDep = Annotated[Ledger, Depends(ledger_of)]


# --------------------------------------------------------------------------- packed encoding


def pack_b64_ids(ids: list[int]) -> str:
    return base64.b64encode(codec.pack_ids(ids)).decode()


def pack_b64_floats(values: list[float]) -> str:
    return base64.b64encode(array("d", values).tobytes()).decode()


def _b64(value: str, field: str) -> bytes:
    try:
        data = base64.b64decode(value, validate=True)
    except ValueError:
        raise InvalidInput(f"{field}: not valid base64 for token_encoding packed-v1") from None
    return data


def unpack_b64_ids(value: str, field: str) -> list[int]:
    data = _b64(value, field)
    if len(data) % 4:
        raise InvalidInput(f"{field}: packed ids must be a multiple of 4 bytes")
    return codec.unpack_ids(data)


def unpack_b64_floats(value: str, field: str) -> list[float]:
    data = _b64(value, field)
    if len(data) % 8:
        raise InvalidInput(f"{field}: packed log-probs must be a multiple of 8 bytes")
    out = array("d")
    out.frombytes(data)
    return out.tolist()


def decode_record(raw: dict[str, Any], encoding: TokenEncoding) -> dict[str, Any]:
    if encoding == "json":
        return raw
    out = dict(raw)
    for name in ("prompt_token_ids", "generation_token_ids"):
        if isinstance(out.get(name), str):
            out[name] = unpack_b64_ids(out[name], name)
    if isinstance(out.get("generation_log_probs"), str):
        out["generation_log_probs"] = unpack_b64_floats(
            out["generation_log_probs"], "generation_log_probs"
        )
    return out


def encode_entry(entry: TokenEntry, encoding: TokenEncoding) -> dict[str, Any]:
    data = entry.model_dump(mode="json")
    if encoding == "packed-v1":
        data["prompt_token_ids"] = pack_b64_ids(entry.prompt_token_ids)
        data["generation_token_ids"] = pack_b64_ids(entry.generation_token_ids)
        data["generation_log_probs"] = pack_b64_floats(entry.generation_log_probs)
    return data


# --------------------------------------------------------------------------- bodies


class TokenRecord(BaseModel):
    """A NeMo Gym schema-version-1 token record (extra fields are kept)."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = 1
    rollout_id: str | None = None
    model_call_id: str | None = None
    model: str = ""
    prompt_token_ids: list[int] | str
    generation_token_ids: list[int] | str
    generation_log_probs: list[float] | str
    routed_experts: Any = None
    output_items: list[dict[str, Any]] = Field(default_factory=list)
    token_item_index: int | None = None
    created_at: float = 0.0
    response_id: str | None = None


class PutBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    record: TokenRecord
    token_encoding: TokenEncoding = "json"
    route: str | None = Field(default=None, max_length=200)
    request_fingerprint: str = Field(default="", max_length=64)
    continuation_fingerprint: str = Field(default="", max_length=64)


class PutOut(BaseModel):
    status: Literal["created", "duplicate"]
    version: int
    parent_call_id: str | None
    prompt_is_delta: bool
    edge_method: str | None


class IntentBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    route: str | None = Field(default=None, max_length=200)
    model: str = Field(default="", max_length=200)


class IntentOut(BaseModel):
    created: bool


class CancelOut(BaseModel):
    cancelled: bool


class IncompleteBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_call_id: str = Field(default="", max_length=200)
    reason: str = Field(default="capture_failed", max_length=64)
    detail: str = Field(default="", max_length=4000)


class VersionOut(BaseModel):
    version: int


class ResolveBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] | str
    token_encoding: TokenEncoding = "json"


class ResolveOut(BaseModel):
    status: Literal["root", "resolved", "unresolved"]
    model_call_id: str | None
    cumulative_token_ids: list[int] | str | None
    digest: str | None
    reason: str
    token_encoding: TokenEncoding


class SnapshotOut(BaseModel):
    rollout_id: str
    entries: list[dict[str, Any]]
    incomplete: bool
    snapshot_id: str
    version: int
    token_encoding: TokenEncoding


class RetireBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    snapshot_id: str = Field(max_length=64)
    version: int


class RetireOut(BaseModel):
    retired: bool


class FinalizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    result: dict[str, Any]
    deliver: Literal["one", "all-chains"] = "one"
    consumer: str = Field(default="", max_length=200)


class FinalizeOut(BaseModel):
    result: dict[str, Any]
    build: dict[str, Any]


class AckBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    durable: bool = True


class DeletedOut(BaseModel):
    deleted: bool


class SweepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    older_than_s: float = Field(ge=0, le=10 * 365 * 86400)


class SweepOut(BaseModel):
    removed: int


class RolloutItem(BaseModel):
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


class RolloutPage(BaseModel):
    items: list[RolloutItem]
    next_cursor: str | None


# --------------------------------------------------------------------------- ingest


@router.post(
    "/rollouts/{rollout_id}/calls/{model_call_id}/intent",
    response_model=IntentOut,
    status_code=201,
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
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


@router.post(
    "/rollouts/{rollout_id}/calls/{model_call_id}/cancel",
    response_model=CancelOut,
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
)
async def cancel_call(rollout_id: RolloutId, model_call_id: CallId, led: LedgerDep) -> CancelOut:
    """Close an intent for a call that ended without generating."""
    return CancelOut(cancelled=await led.cancel_call(rollout_id, model_call_id))


@router.put(
    "/rollouts/{rollout_id}/calls/{model_call_id}",
    response_model=PutOut,
    status_code=201,
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
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
    for key, expected in (("rollout_id", rollout_id), ("model_call_id", model_call_id)):
        if raw.get(key) not in (None, expected):
            raise InvalidInput(f"record.{key} {raw[key]!r} does not match the path ({expected!r})")
        raw[key] = expected
    entry = coerce_entry(raw)
    metrics = request.app.state.metrics
    started = time.perf_counter()
    try:
        res = await led.put(
            entry,
            route=body.route,
            request_fingerprint=body.request_fingerprint,
            continuation_fingerprint=body.continuation_fingerprint,
        )
    except Exception as exc:
        metrics.ingest.labels("put", type(exc).__name__).inc()
        raise
    metrics.ingest_seconds.labels("put").observe(time.perf_counter() - started)
    metrics.ingest.labels("put", res.status).inc()
    if res.status == "duplicate":
        response.status_code = 200
    return PutOut(
        status="created" if res.status == "created" else "duplicate",
        version=res.version,
        parent_call_id=res.parent_call_id,
        prompt_is_delta=res.prompt_is_delta,
        edge_method=res.edge_method,
    )


@router.post(
    "/rollouts/{rollout_id}/incomplete",
    response_model=VersionOut,
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
)
async def mark_incomplete(
    rollout_id: RolloutId, body: IncompleteBody, led: LedgerDep, request: Request
) -> VersionOut:
    """Durably mark the rollout incomplete with a reason (allowed after freeze)."""
    version = await led.mark_incomplete(
        rollout_id, body.model_call_id, reason=body.reason, detail=body.detail
    )
    request.app.state.metrics.incomplete.labels(body.reason).inc()
    return VersionOut(version=version)


@router.post(
    "/rollouts/{rollout_id}/lineage/resolve",
    response_model=ResolveOut,
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
)
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


# --------------------------------------------------------------------------- trainer


@router.post(
    "/rollouts/{rollout_id}/freeze",
    response_model=SnapshotOut,
    tags=["trainer"],
    dependencies=[Depends(require("trainer"))],
)
async def freeze(
    rollout_id: RolloutId,
    led: LedgerDep,
    request: Request,
    token_encoding: TokenEncoding = "json",
) -> SnapshotOut:
    """Freeze (idempotent) and return full-prompt entries from one consistent read."""
    snap = await led.freeze(rollout_id)
    request.app.state.metrics.freezes.inc()
    return SnapshotOut(
        rollout_id=snap.rollout_id,
        entries=[encode_entry(e, token_encoding) for e in snap.entries],
        incomplete=snap.incomplete,
        snapshot_id=snap.snapshot_id,
        version=snap.version,
        token_encoding=token_encoding,
    )


@router.post(
    "/finalize",
    response_model=FinalizeOut,
    tags=["trainer"],
    dependencies=[Depends(require("trainer"))],
)
async def finalize(body: FinalizeBody, led: LedgerDep, request: Request) -> FinalizeOut:
    """Rebuild one rollout result: freeze, build, project, mask; returns result and build."""
    from ledger.delivery import finalize_rollout_token_capture

    result = body.result
    build = await finalize_rollout_token_capture(
        result, led, deliver=body.deliver, consumer=body.consumer
    )
    assert build is not None
    metrics = request.app.state.metrics
    metrics.builds.labels(str(build.get("outcome"))).inc()
    for reason in build.get("mask_reasons") or []:
        metrics.masked.labels(reason).inc()
    slim = {k: v for k, v in build.items() if k != "rebuilt_response"}
    return FinalizeOut(result=result, build=slim)


@router.post(
    "/rollouts/{rollout_id}/retire",
    response_model=RetireOut,
    tags=["trainer"],
    dependencies=[Depends(require("trainer"))],
    responses={409: {"description": "Not frozen at that snapshot identity: nothing retired."}},
)
async def retire(
    rollout_id: RolloutId, body: RetireBody, led: LedgerDep, request: Request, response: Response
) -> RetireOut:
    """Retire exactly the consumed snapshot; 409 if anything changed since."""
    ok = await led.retire(rollout_id, snapshot_id=body.snapshot_id, version=body.version)
    request.app.state.metrics.retires.labels("retired" if ok else "stale").inc()
    if not ok:
        response.status_code = 409
    return RetireOut(retired=ok)


@router.post(
    "/deliveries/{delivery_id}/ack",
    status_code=204,
    tags=["trainer"],
    dependencies=[Depends(require("trainer"))],
)
async def ack_delivery(
    delivery_id: Annotated[int, Path(ge=1, le=2**62)], body: AckBody, led: LedgerDep
) -> Response:
    """Record that the consumer stored the delivered rollout durably."""
    await led.mark_delivery(delivery_id, durable=body.durable)
    return Response(status_code=204)


# --------------------------------------------------------------------------- admin


@router.delete(
    "/rollouts/{rollout_id}",
    response_model=DeletedOut,
    tags=["admin"],
    dependencies=[Depends(require("admin"))],
)
async def delete_rollout(rollout_id: RolloutId, led: LedgerDep) -> DeletedOut:
    """Remove every trace of a rollout before re-dispatching its id."""
    return DeletedOut(deleted=await led.delete_rollout(rollout_id))


@router.post(
    "/admin/sweep",
    response_model=SweepOut,
    tags=["admin"],
    dependencies=[Depends(require("admin"))],
)
async def sweep(body: SweepBody, led: LedgerDep) -> SweepOut:
    """Remove retired tombstones older than ``older_than_s``."""
    return SweepOut(removed=await led.sweep(timedelta(seconds=body.older_than_s)))


# --------------------------------------------------------------------------- audit


@router.get(
    "/rollouts",
    response_model=RolloutPage,
    tags=["audit"],
    dependencies=[Depends(require("audit"))],
)
async def list_rollouts(
    led: LedgerDep,
    state: Literal["open", "frozen", "retired"] | None = None,
    outcome: Literal["delivered", "masked", "failed"] | None = None,
    masked: bool | None = None,
    reason: Annotated[str | None, Query(max_length=64)] = None,
    since: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=MAX_ROLLOUT_ID_LEN)] = None,
) -> RolloutPage:
    """Rollouts with filters, ordered by id, with cursor pagination."""
    items, nxt = await Audit(led).list_rollouts(
        state=state,
        outcome=outcome,
        masked=masked,
        reason=reason,
        since=since,
        limit=limit,
        cursor=cursor,
    )
    return RolloutPage(
        items=[RolloutItem.model_validate(i, from_attributes=True) for i in items],
        next_cursor=nxt,
    )


@router.get("/rollouts/{rollout_id}", tags=["audit"], dependencies=[Depends(require("audit"))])
async def show_rollout(rollout_id: RolloutId, led: LedgerDep) -> dict[str, Any]:
    """One rollout in full: calls, edges, quarantines, incomplete events, deliveries."""
    return await Audit(led).rollout_detail(rollout_id)


@router.get("/stats", tags=["audit"], dependencies=[Depends(require("audit"))])
async def stats(led: LedgerDep, since: datetime | None = None) -> dict[str, Any]:
    """Counts by state, outcome and reason; mask fraction; delivered-fraction distribution."""
    return await Audit(led).stats(since=since)
