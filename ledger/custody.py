"""NeMo Gym 0.7.0's ``CaptureLedger`` over the SQL ledger: token-free custody rows.

With ``external_staging: true`` a framework's inference worker keeps the token arrays; Gym's
model server writes, per call, only metadata (``CaptureLedgerCommit``: the ``CallRecord`` custody
columns, the staging chain, the request and response items) or a failure (a poison row).  The
framework reads the rollout's ``manifest`` and verifies the staged tokens itself.  Named
operations, each one transaction on one rollout:

- ``record(ledger, commit)``: publish a staged call for request-time resolution; write-once per
  call id (the identical row again is a no-op, other data ``PayloadConflict``); committed, so
  visible to every worker, before it returns;
- ``record_failure(ledger, rollout_id, model_call_id, reason)``: a poison row (idempotent for
  the same reason); never a lineage candidate;
- ``manifest(ledger, rollout_id)``: the ``RolloutManifest`` payload (committed ``records`` as
  ``CallRecord`` payloads, ``failures``), never token ids; a committed row without its response
  id or chain digests is reported as a failure, as 0.7.0 does;
- ``has_rows(ledger, rollout_id)``: whether any custody row (committed or failed) exists;
- ``custody_match``: the resolver's fallback when no token record resolves a request: exactly
  one committed row under the request's fingerprint (fingerprint version 2) whose recorded
  context verifies; the match carries no tokens (the staging chain, ``prev_len`` = ``cum_len``,
  the chain hash and the cumulative hash as its digest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.engine import Connection

from ledger.errors import InvalidInput, PayloadConflict
from ledger.gym_fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from ledger.gym_lineage import LineageMatch
from ledger.ids import validate_rollout_id
from ledger.storage import queries
from ledger.store import Ledger

__all__ = [
    "CallRecordIn",
    "CaptureLedgerCommitIn",
    "custody_match",
    "has_rows",
    "manifest",
    "record",
    "record_failure",
]

# 0.7.0 staging wire versions (``staging.digest``) that manifests carry.
STAGING_SCHEMA_VERSION = 2
STAGING_DIGEST_VERSION = 2
EXTRAS_DIGEST_VERSION = 1
MISSING_RESPONSE_ID = "ledger_row_missing_response_id"
MISSING_CHAIN_HASH = "ledger_row_missing_chain_hash"

Identifier = Annotated[str, Field(min_length=1, max_length=200)]
Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class CallRecordIn(BaseModel):
    """0.7.0's ``CallRecord`` (token-free manifest row), as it arrives."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = STAGING_SCHEMA_VERSION
    digest_version: int = STAGING_DIGEST_VERSION
    extras_digest_version: int = EXTRAS_DIGEST_VERSION
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: int = Field(ge=0)
    delta_len: int = Field(ge=0)
    cum_len: int = Field(ge=0)
    weight_version: int = Field(ge=0)
    digest: Hex
    extras_digest: Hex
    staging_key: Identifier
    mode: str = Field(default="token_in", pattern=r"^(token_in|text)$")
    chain_hash: Hex
    cumulative_hash: Hex
    response_id: Identifier
    admitted_at: float | None = Field(default=None, allow_inf_nan=False)
    output_fingerprint: Hex | None = None
    continuation_fingerprint: Hex | None = None
    fingerprint_version: int = Field(default=0, ge=0)


class CaptureLedgerCommitIn(BaseModel):
    """0.7.0's ``CaptureLedgerCommit``, as it arrives (the release's object or its JSON)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = STAGING_SCHEMA_VERSION
    rollout_id: Identifier
    record: CallRecordIn
    staging_chain: list[Identifier] = Field(default_factory=list)
    request_items: list[dict[str, Any]]
    response_items: list[dict[str, Any]]


def parse_commit(commit: Any) -> CaptureLedgerCommitIn:
    dump = getattr(commit, "model_dump", None)
    data = dump(mode="json") if callable(dump) else commit
    try:
        return CaptureLedgerCommitIn.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise InvalidInput(f"invalid capture-ledger commit: {where}: {first.get('msg')}") from None


def _custody_columns(commit: CaptureLedgerCommitIn) -> dict[str, Any]:
    r = commit.record
    return {
        "parent_call_id": r.parent_call_id,
        "staging_key": r.staging_key,
        "weight_version": r.weight_version,
        "prev_len": r.prev_len,
        "delta_len": r.delta_len,
        "cum_len": r.cum_len,
        "staging_digest": r.digest,
        "extras_digest": r.extras_digest,
        "mode": r.mode,
        "admitted_at": r.admitted_at,
        "staging_chain": list(commit.staging_chain),
        "chain_hash": r.chain_hash,
        "cumulative_hash": r.cumulative_hash,
        "response_id": r.response_id,
        "output_fingerprint": r.output_fingerprint or None,
        "continuation_fingerprint": r.continuation_fingerprint or None,
        "fingerprint_version": r.fingerprint_version,
    }


def _digest(row: Mapping[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(row, option=orjson.OPT_SORT_KEYS)).hexdigest()


async def record(ledger: Ledger, commit: Any) -> bool:
    """Publish one staged call (write-once per call id); True when it was new."""
    c = parse_commit(commit)
    rid = validate_rollout_id(c.rollout_id)
    try:
        fingerprint = assistant_fingerprint([*c.request_items, *c.response_items])
        context_digest = conversation_digest(c.request_items)
    except (ValueError, TypeError, AttributeError) as exc:
        raise InvalidInput(f"capture-ledger commit items cannot be fingerprinted: {exc}") from None
    row = {
        "model_call_id": c.record.model_call_id,
        "fingerprint": fingerprint,
        "context_len": len(c.request_items),
        "context_digest": context_digest,
        "digest": c.record.cumulative_hash,
        **_custody_columns(c),
    }
    digest = _digest(row)
    cid = c.record.model_call_id

    def body(conn: Connection) -> bool:
        ledger._lock_rollout(conn, rid)
        existing = conn.execute(queries.committed_custody_digest(rid, cid)).scalar_one_or_none()
        if existing is not None:
            if existing != digest:
                raise PayloadConflict(
                    f"capture-ledger row for model call {cid!r} of rollout {rid!r} was already "
                    "recorded with different data; the first row is kept",
                    rollout_id=rid,
                )
            return False
        conn.execute(
            queries.insert_custody_row(
                rollout_id=rid,
                model_call_id=cid,
                failure_reason="",
                fingerprint=fingerprint or None,
                # As 0.7.0: the record's own fingerprint version gates resolution.
                fingerprint_version=c.record.fingerprint_version,
                context_len=len(c.request_items),
                context_digest=context_digest,
                row=row,
                row_digest=digest,
            )
        )
        return True

    return bool(await ledger._transact(body))


async def record_failure(ledger: Ledger, rollout_id: str, model_call_id: str, reason: str) -> None:
    """Record a call whose capture did not complete (a poison row; idempotent per reason)."""
    rid = validate_rollout_id(rollout_id)
    for name, value in (("model_call_id", model_call_id), ("reason", reason)):
        if not isinstance(value, str) or not 1 <= len(value) <= 200:
            raise InvalidInput(f"{name} must be a non-empty string of at most 200 characters")
    row = {"model_call_id": model_call_id, "failure_reason": reason}

    def body(conn: Connection) -> None:
        ledger._lock_rollout(conn, rid)
        conn.execute(
            queries.insert_custody_failure(
                ledger.sql,
                rollout_id=rid,
                model_call_id=model_call_id,
                failure_reason=reason,
                context_len=0,
                row=row,
                row_digest=_digest(row),
            )
        )

    await ledger._transact(body)


async def manifest(ledger: Ledger, rollout_id: str) -> dict[str, Any]:
    """The rollout's token-free ledger as a ``RolloutManifest`` payload."""
    rid = validate_rollout_id(rollout_id)
    async with ledger._read() as conn:
        rows = (await conn.execute(queries.custody_manifest_rows(rid))).all()
    records: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []

    def fail(call_id: str, reason: str) -> None:
        failures.append(
            {"schema_version": STAGING_SCHEMA_VERSION, "model_call_id": call_id, "reason": reason}
        )

    for r in rows:
        row = r.row or {}
        if r.failure_reason:
            fail(r.model_call_id, r.failure_reason)
        elif not row.get("response_id"):
            fail(r.model_call_id, MISSING_RESPONSE_ID)
        elif not row.get("chain_hash") or not row.get("cumulative_hash"):
            fail(r.model_call_id, MISSING_CHAIN_HASH)
        else:
            records.append(_call_record(r.model_call_id, row))
    return {
        "schema_version": STAGING_SCHEMA_VERSION,
        "rollout_id": rid,
        "records": records,
        "failures": failures,
    }


def _call_record(call_id: str, row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "schema_version": STAGING_SCHEMA_VERSION,
        "digest_version": STAGING_DIGEST_VERSION,
        "extras_digest_version": EXTRAS_DIGEST_VERSION,
        "model_call_id": call_id,
        "parent_call_id": row.get("parent_call_id"),
        "prev_len": int(row["prev_len"]),
        "delta_len": int(row["delta_len"]),
        "cum_len": int(row["cum_len"]),
        "weight_version": int(row["weight_version"]),
        "digest": str(row["staging_digest"]),
        "extras_digest": str(row["extras_digest"]),
        "staging_key": str(row["staging_key"]),
        "mode": str(row["mode"]),
        "chain_hash": str(row["chain_hash"]),
        "cumulative_hash": str(row["cumulative_hash"]),
        "response_id": str(row["response_id"]),
        "admitted_at": row.get("admitted_at"),
        "output_fingerprint": row.get("output_fingerprint") or None,
        "continuation_fingerprint": row.get("continuation_fingerprint") or None,
        "fingerprint_version": int(row.get("fingerprint_version") or 0),
    }


async def has_rows(ledger: Ledger, rollout_id: str) -> bool:
    """Whether any custody row (committed or failed) exists for the rollout."""
    rid = validate_rollout_id(rollout_id)
    async with ledger._read() as conn:
        found = (await conn.execute(queries.any_custody_row(rid))).first()
    return found is not None


def custody_match(
    conn: Connection, rollout_id: str, fingerprint: str, request_items: Sequence[Any]
) -> LineageMatch | None:
    """The single committed custody row a request continues, or None (never a guess)."""
    rows = conn.execute(
        queries.custody_candidates(rollout_id, fingerprint, FINGERPRINT_VERSION)
    ).all()
    if len(rows) != 1:
        return None
    (r,) = rows
    items = list(request_items)
    if len(items) < r.context_len or conversation_digest(items[: r.context_len]) != (
        r.context_digest or ""
    ):
        return None
    row = r.row
    return LineageMatch(
        model_call_id=str(row["model_call_id"]),
        cumulative_token_ids=(),
        digest=str(row["digest"]),
        staging_chain=tuple(str(s) for s in row.get("staging_chain") or ()),
        prev_len=int(row.get("cum_len") or 0),
        chain_hash=str(row.get("chain_hash") or ""),
    )
