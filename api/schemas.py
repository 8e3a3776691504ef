"""The ledger API's request bodies and answers (pydantic), shared by ``api.routes``.

Token arrays travel as JSON lists by default, or with ``token_encoding: "packed-v1"`` as base64
of little-endian int32 ids and float64 log-probs (exact for every value, ``-inf`` included).  In
JSON responses a non-finite log-prob is written as the string ``"-Infinity"`` (JSON has no
literal for it); requests may send it the same way.

Every error answer has the body ``{"error": {"code", "message", ...}}`` (``ErrorBody``).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ledger.token_rules import check_created_at, check_log_probs, check_token_ids
from ledger.wire import TokenEncoding

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
REASON_PATTERN = r"^[a-z][a-z0-9_]*$"


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


# --------------------------------------------------------------------------- storable text


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
