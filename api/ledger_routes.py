"""The ledger API under ``/ledger/v1/``: ingest, trainer, admin and audit routes.

Routes are thin: parse, call one ledger operation, return its result.  Errors are mapped to
HTTP in ``api.errors``.  Token arrays travel as JSON lists by default, or with
``token_encoding: "packed-v1"`` as base64 of little-endian int32 ids and float64 log-probs
(exact for every value, ``-inf`` included).  In JSON responses a non-finite log-prob is written
as the string ``"-Infinity"`` (JSON has no literal for it); requests may send it the same way.

Every error answer has the body ``{"error": {"code", "message", ...}}`` naming what was wrong.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from api.auth import require
from api.limits import BoundedJsonRoute, check_record_tokens, encode_entries_off_loop
from api.metrics import incomplete_label
from ledger.errors import InvalidInput, NotFound, PayloadConflict, RolloutRetired, StateConflict
from ledger.ids import MAX_ROLLOUT_ID_LEN
from ledger.records import coerce_entry
from ledger.store import Audit, Ledger
from ledger.token_rules import check_created_at, check_log_probs, check_token_ids
from ledger.wire import (
    TokenEncoding,
    decode_record,
    finite_json,
    pack_b64_ids,
    unpack_b64_ids,
)

log = logging.getLogger("rollout_ledger.api.ledger")

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
REASON_PATTERN = r"^[a-z][a-z0-9_]*$"
RolloutId = Annotated[
    str, Path(pattern=ID_PATTERN, max_length=MAX_ROLLOUT_ID_LEN, description="Rollout id.")
]
CallId = Annotated[str, Path(pattern=ID_PATTERN, max_length=200, description="Model call id.")]


# --------------------------------------------------------------------------- errors


class Problem(BaseModel):
    field: str
    message: str


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    code: str = Field(description="Machine-readable error code, e.g. payload_conflict.")
    message: str = Field(description="What was wrong, for a person.")
    rollout_id: str | None = None
    problems: list[Problem] | None = Field(
        default=None, description="Validation errors: each names the failing field."
    )


class ErrorBody(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail


def _err(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    401: _err("Missing or unknown bearer token."),
    403: _err("The token lacks the scope this route needs."),
    413: _err("The request body exceeds max_body_bytes, or the record max_record_tokens."),
    422: _err("Invalid input; the message names the failing field."),
    503: _err("The database cannot be reached."),
}

router = APIRouter(prefix="/ledger/v1", responses=COMMON_ERRORS, route_class=BoundedJsonRoute)


class StaleSnapshot(StateConflict):
    """Retire named a snapshot identity the rollout is not frozen at: nothing was retired."""

    code = "stale_snapshot"


def _text_problem(value: str) -> str | None:
    # Postgres text cannot hold NUL, and no database takes a lone UTF-16 surrogate.
    if "\x00" in value:
        return "must not contain the NUL character (\\u0000)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode text (it holds a lone surrogate)"
    return None


def _storable_text(value: str) -> str:
    if problem := _text_problem(value):
        raise ValueError(problem)
    return value


Text = Annotated[str, AfterValidator(_storable_text)]
INT64 = 2**63


def _unstorable(value: Any, path: str) -> str | None:
    """``"<path> <what is wrong>"`` for the first value JSON storage cannot hold, or None."""
    if isinstance(value, str):
        problem = _text_problem(value)
        return f"{path} {problem}" if problem else None
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if -INT64 <= value < INT64 else f"{path} is an integer beyond 64 bits"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path} must be a finite number, not {value}"
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}"
            if problem := _text_problem(str(k)):
                return f"{sub}: the key {problem}"
            if found := _unstorable(v, sub):
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if found := _unstorable(v, f"{path}.{i}"):
                return found
    return None


def ledger_of(request: Request) -> Ledger:
    led: Ledger = request.app.state.ledger
    return led


LedgerDep = Annotated[Ledger, Depends(ledger_of)]


# --------------------------------------------------------------------------- bodies


class TokenRecord(BaseModel):
    """A NeMo Gym schema-version-1 token record (extra fields are kept)."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = 1
    rollout_id: str | None = None
    model_call_id: str | None = None
    model: Text = Field(default="", max_length=200)
    prompt_token_ids: list[int] | str
    generation_token_ids: list[int] | str
    generation_log_probs: list[float] | str = Field(
        description='Log-probs; a non-finite value may be sent as the string "-Infinity".'
    )
    routed_experts: Any = None
    output_items: list[dict[str, Any]] = Field(default_factory=list)
    token_item_index: int | None = None
    created_at: float = Field(default=0.0, allow_inf_nan=False)
    response_id: Text | None = Field(default=None, max_length=200)

    # The shared token rules' type checks (ledger.token_rules) before pydantic's lax coercion,
    # which would read true as 1 and "7" as 7; ranges (and packed arrays, once decoded) are
    # checked by TokenEntry with the same rules.
    @field_validator("prompt_token_ids", "generation_token_ids", mode="before")
    @classmethod
    def _token_ids(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str):
            return v
        return check_token_ids(v, str(info.field_name), types_only=True)

    @field_validator("generation_log_probs", mode="before")
    @classmethod
    def _log_probs(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        return check_log_probs(v, "generation_log_probs", types_only=True)

    @field_validator("created_at", mode="before")
    @classmethod
    def _created_at(cls, v: Any) -> Any:
        return check_created_at(v)

    @model_validator(mode="after")
    def _storable(self) -> TokenRecord:
        for name in ("output_items", "routed_experts"):
            if found := _unstorable(getattr(self, name), name):
                raise ValueError(found)
        if found := _unstorable(dict(self.__pydantic_extra__ or {}), "record"):
            raise ValueError(found)
        return self


class PutBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    record: TokenRecord
    token_encoding: TokenEncoding = "json"
    route: Text | None = Field(default=None, max_length=200)
    request_fingerprint: Text = Field(default="", max_length=64)
    continuation_fingerprint: Text = Field(default="", max_length=64)


class PutOut(BaseModel):
    status: Literal["created", "duplicate"]
    version: int
    parent_call_id: str | None
    prompt_is_delta: bool
    edge_method: str | None


class IntentBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    route: Text | None = Field(default=None, max_length=200)
    model: Text = Field(default="", max_length=200)


class IntentOut(BaseModel):
    created: bool


class CancelOut(BaseModel):
    cancelled: bool


class IncompleteBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Any call id, even one ``put`` refused: marking must be more available than ``put``.
    model_call_id: str = Field(default="", max_length=100_000)
    reason: str = Field(default="capture_failed", max_length=64, pattern=REASON_PATTERN)
    detail: Text = Field(default="", max_length=4000)


class VersionOut(BaseModel):
    version: int


class ResolveBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] | str
    token_encoding: TokenEncoding = "json"

    @field_validator("prompt_token_ids", mode="before")
    @classmethod
    def _token_ids(cls, v: Any) -> Any:
        return v if isinstance(v, str) else check_token_ids(v, "prompt_token_ids")


class ResolveOut(BaseModel):
    status: Literal["root", "resolved", "unresolved"]
    model_call_id: str | None
    cumulative_token_ids: list[int] | str | None
    digest: str | None
    reason: str
    token_encoding: TokenEncoding


class ResolveRequestBody(BaseModel):
    """NeMo Gym 0.7.0's ``LineageResolver.resolve`` input: the harness's unmodified items."""

    model_config = ConfigDict(extra="forbid")

    request_items: list[Any]
    token_encoding: TokenEncoding = "json"


class LineageMatchOut(BaseModel):
    model_call_id: str
    cumulative_token_ids: list[int] | str
    digest: str
    staging_chain: list[str]
    prev_len: int
    chain_hash: str


class ResolveRequestOut(BaseModel):
    status: Literal["root", "resolved", "unresolved"]
    match: LineageMatchOut | None
    reason: str
    token_encoding: TokenEncoding


class CustodyRecordBody(BaseModel):
    """NeMo Gym 0.7.0 ``CaptureLedger.record``: one ``CaptureLedgerCommit`` as JSON."""

    model_config = ConfigDict(extra="forbid")

    commit: dict[str, Any]


class CustodyRecordOut(BaseModel):
    created: bool


class CustodyFailureBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_call_id: Text = Field(min_length=1, max_length=200)
    reason: Text = Field(min_length=1, max_length=200)


class HasRowsOut(BaseModel):
    has_rows: bool


class SnapshotOut(BaseModel):
    rollout_id: str
    entries: list[dict[str, Any]]
    incomplete: bool
    snapshot_id: str
    version: int
    token_encoding: TokenEncoding


class RetireBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    snapshot_id: Text = Field(max_length=64)
    version: int = Field(ge=0, le=2**62)


class RetireOut(BaseModel):
    retired: bool


class FinalizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    result: dict[str, Any]
    deliver: Literal["one", "all-chains"] = "one"
    consumer: Text = Field(default="", max_length=200)


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


def _since_utc(value: datetime | None) -> datetime | None:
    """``since=`` in UTC: SQLite compares stored UTC wall-clock text, so an offset must be
    applied here (a value without one is taken as UTC)."""
    if value is None:
        return None
    return value.astimezone(UTC) if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _utc(value: datetime) -> datetime:
    # SQLite hands timestamps back without their zone; the ledger stores UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_utc)]


class RolloutItem(BaseModel):
    rollout_id: str
    state: str
    incomplete: bool
    version: int
    n_calls: int
    created_at: UtcDatetime
    updated_at: UtcDatetime
    outcome: str | None
    mask_reasons: list[str]
    delivered_fraction: float | None
    chains: int | None
    incomplete_reasons: list[str] = []


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


@router.post(
    "/rollouts/{rollout_id}/lineage/resolve-request",
    response_model=ResolveRequestOut,
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
)
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
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
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


@router.post(
    "/rollouts/{rollout_id}/custody/failures",
    status_code=204,
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
)
async def custody_record_failure(
    rollout_id: RolloutId, body: CustodyFailureBody, led: LedgerDep
) -> Response:
    """NeMo Gym 0.7.0 ``CaptureLedger.record_failure``: a poison row for a call."""
    from ledger import custody

    await custody.record_failure(led, rollout_id, body.model_call_id, body.reason)
    return Response(status_code=204)


@router.get(
    "/rollouts/{rollout_id}/custody/manifest",
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
)
async def custody_manifest(rollout_id: RolloutId, led: LedgerDep) -> dict[str, Any]:
    """NeMo Gym 0.7.0 ``CaptureLedger.manifest``: the token-free ``RolloutManifest``."""
    from ledger import custody

    return await custody.manifest(led, rollout_id)


@router.get(
    "/rollouts/{rollout_id}/custody/has-rows",
    response_model=HasRowsOut,
    tags=["ingest"],
    dependencies=[Depends(require("ingest"))],
)
async def custody_has_rows(rollout_id: RolloutId, led: LedgerDep) -> HasRowsOut:
    """NeMo Gym 0.7.0 ``CaptureLedger.has_rows``."""
    from ledger import custody

    return HasRowsOut(has_rows=await custody.has_rows(led, rollout_id))


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
    return FinalizeOut(result=finite_json(result), build=finite_json(slim))


@router.post(
    "/rollouts/{rollout_id}/retire",
    response_model=RetireOut,
    tags=["trainer"],
    dependencies=[Depends(require("trainer"))],
    responses={
        200: {
            "model": RetireOut,
            "description": "Retired (or already retired at exactly this "
            "snapshot identity: a safe repeat).",
        },
        404: _err("No such rollout."),
        409: _err("Not frozen at that snapshot identity: nothing retired."),
        410: _err("Already retired at another snapshot identity."),
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


@router.get("/rollouts/{rollout_id}", tags=["audit"], dependencies=[Depends(require("audit"))])
async def show_rollout(rollout_id: RolloutId, led: LedgerDep) -> dict[str, Any]:
    """One rollout in full: calls, edges, quarantines, incomplete events, deliveries."""
    return await Audit(led).rollout_detail(rollout_id)


@router.get("/stats", tags=["audit"], dependencies=[Depends(require("audit"))])
async def stats(led: LedgerDep, since: datetime | None = None) -> dict[str, Any]:
    """Counts by state, outcome and reason; mask fraction; delivered-fraction distribution."""
    return await Audit(led).stats(since=_since_utc(since))
