"""SQL tables (design §3) as SQLAlchemy 2 typed models.

Narrow status rows (``rollouts``, ``calls``) are kept apart from the insert-only wide rows of
packed tokens (``call_tokens``), so state transitions never rewrite large rows.  A naming
convention keeps constraint names identical on SQLite and Postgres: the storage layer translates
driver errors by those names.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ROLLOUT_STATES = ("open", "frozen", "retired")
CALL_STATUSES = ("intent", "captured", "cancelled")
EDGE_STATUSES = ("verified", "ambiguous", "drifted")
DELIVERY_OUTCOMES = ("delivered", "masked", "failed")

# JSONB on Postgres (indexable, compact), plain JSON text on SQLite.
Json = JSON().with_variant(JSONB(), "postgresql")
# BigInteger primary keys that still autoincrement on SQLite (where only INTEGER PRIMARY KEY does).
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: DateTime(timezone=True), dict[str, Any]: Json}


class Rollout(Base):
    __tablename__ = "rollouts"
    __table_args__ = (
        CheckConstraint(_in("state", ROLLOUT_STATES), name="state"),
        CheckConstraint("version >= 0", name="version_nonnegative"),
        Index(None, "state", "retired_at"),
    )

    rollout_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="open")
    incomplete: Mapped[bool] = mapped_column(Boolean, default=False)
    snapshot_id: Mapped[str | None] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    frozen_at: Mapped[datetime | None]
    retired_at: Mapped[datetime | None]


# The calls' partial indexes hold captured calls only: one condition, given to each dialect.
_CAPTURED = text("status = 'captured'")
_CAPTURED_ONLY: dict[str, Any] = {"sqlite_where": _CAPTURED, "postgresql_where": _CAPTURED}


class Call(Base):
    __tablename__ = "calls"
    __table_args__ = (
        UniqueConstraint("rollout_id", "model_call_id"),
        CheckConstraint(_in("status", CALL_STATUSES), name="status"),
        CheckConstraint(
            "status != 'captured' OR (prompt_len >= 0 AND generation_len >= 0 "
            "AND cumulative_len = prompt_len + generation_len)",
            name="lengths",
        ),
        # Lineage candidates and continuation lookups read captured calls only: intents stay
        # out of these indexes, so registering one and turning it into a record touch neither
        # (migration 0005).
        Index(None, "rollout_id", "cumulative_len", **_CAPTURED_ONLY),
        Index(None, "rollout_id", "continuation_fingerprint", **_CAPTURED_ONLY),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollouts.rollout_id", ondelete="CASCADE"))
    model_call_id: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(200), default="")
    route: Mapped[str | None] = mapped_column(String(200))
    response_id: Mapped[str | None] = mapped_column(String(200))
    schema_version: Mapped[int | None] = mapped_column(Integer)
    payload_digest: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[float | None] = mapped_column(Float)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    recorded_at: Mapped[datetime | None]
    prompt_len: Mapped[int | None] = mapped_column(Integer)
    generation_len: Mapped[int | None] = mapped_column(Integer)
    cumulative_len: Mapped[int | None] = mapped_column(Integer)
    prompt_digest: Mapped[str | None] = mapped_column(String(64))
    cumulative_digest: Mapped[str | None] = mapped_column(String(64))
    parent_call_id: Mapped[str | None] = mapped_column(String(200))
    prompt_is_delta: Mapped[bool] = mapped_column(Boolean, default=False)
    # Plain JSON, not JSONB: a record's JSON must come back with the sender's key order.
    output_items: Mapped[list[Any] | None] = mapped_column(JSON)
    token_item_index: Mapped[int | None] = mapped_column(Integer)
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    request_fingerprint: Mapped[str | None] = mapped_column(String(64))
    continuation_fingerprint: Mapped[str | None] = mapped_column(String(64))


class CallTokens(Base):
    """Insert-only packed token arrays of one captured call."""

    __tablename__ = "call_tokens"
    __table_args__ = (
        CheckConstraint("prompt_count >= 0 AND generation_count >= 0", name="counts"),
    )

    call_id: Mapped[int] = mapped_column(
        BigId, ForeignKey("calls.id", ondelete="CASCADE"), primary_key=True
    )
    ids_codec: Mapped[str] = mapped_column(String(8))
    log_prob_codec: Mapped[str] = mapped_column(String(8))
    prompt_count: Mapped[int] = mapped_column(Integer)
    generation_count: Mapped[int] = mapped_column(Integer)
    prompt_ids: Mapped[bytes] = mapped_column(LargeBinary)
    generation_ids: Mapped[bytes] = mapped_column(LargeBinary)
    log_probs: Mapped[bytes] = mapped_column(LargeBinary)
    routed_experts: Mapped[Any | None] = mapped_column(JSON)


class LineageEdge(Base):
    __tablename__ = "lineage_edges"
    __table_args__ = (
        UniqueConstraint("child_id", "parent_id"),
        CheckConstraint(_in("status", EDGE_STATUSES), name="status"),
        Index(None, "rollout_id"),
        # No index on child_id alone: the unique constraint above leads with it.
        Index(None, "parent_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollouts.rollout_id", ondelete="CASCADE"))
    child_id: Mapped[int] = mapped_column(BigId, ForeignKey("calls.id", ondelete="CASCADE"))
    parent_id: Mapped[int] = mapped_column(BigId, ForeignKey("calls.id", ondelete="CASCADE"))
    method: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    shared_len: Mapped[int] = mapped_column(Integer)
    mismatch_pos: Mapped[int | None] = mapped_column(Integer)
    mismatch_kind: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class QuarantineRow(Base):
    __tablename__ = "quarantines"
    __table_args__ = (Index(None, "rollout_id"), Index(None, "delivery_id"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollouts.rollout_id", ondelete="CASCADE"))
    delivery_id: Mapped[int | None] = mapped_column(
        BigId, ForeignKey("deliveries.id", ondelete="CASCADE")
    )
    model_call_id: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class IncompleteEvent(Base):
    __tablename__ = "incomplete_events"
    __table_args__ = (Index(None, "rollout_id"), Index(None, "reason"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollouts.rollout_id", ondelete="CASCADE"))
    model_call_id: Mapped[str] = mapped_column(String(200), default="")
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Delivery(Base):
    """One build of a frozen snapshot, with its outcome and everything needed to audit it."""

    __tablename__ = "deliveries"
    __table_args__ = (
        CheckConstraint(_in("outcome", DELIVERY_OUTCOMES), name="outcome"),
        UniqueConstraint("idempotency_key"),
        Index(None, "rollout_id"),
        Index(None, "outcome", "built_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollouts.rollout_id", ondelete="CASCADE"))
    snapshot_id: Mapped[str | None] = mapped_column(String(64))
    version: Mapped[int | None] = mapped_column(BigInteger)
    outcome: Mapped[str] = mapped_column(String(16))
    mask_reasons: Mapped[list[Any]] = mapped_column(Json, default=list)
    metrics: Mapped[dict[str, Any]]
    terminal: Mapped[dict[str, Any] | None]
    consumer: Mapped[str] = mapped_column(String(200), default="")
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    built_at: Mapped[datetime] = mapped_column(default=utcnow)
    handed_off_at: Mapped[datetime | None]
    durable_ack_at: Mapped[datetime | None]
    retired_at: Mapped[datetime | None]


class CustodyRow(Base):
    """NeMo Gym 0.7.0 ``CaptureLedger`` rows: token-free metadata of externally staged calls.

    A committed row (``failure_reason`` empty) is written once per call id and is a lineage
    candidate under ``fingerprint``; a failure row poisons the rollout and is never a parent.
    ``row`` holds the custody columns the manifest is rebuilt from; ``row_digest`` identifies it
    for write-once comparison.
    """

    __tablename__ = "custody_rows"
    __table_args__ = (
        UniqueConstraint("rollout_id", "model_call_id", "failure_reason"),
        Index(None, "rollout_id", "fingerprint"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollouts.rollout_id", ondelete="CASCADE"))
    model_call_id: Mapped[str] = mapped_column(String(200))
    failure_reason: Mapped[str] = mapped_column(String(200), default="")
    fingerprint: Mapped[str | None] = mapped_column(String(64))
    fingerprint_version: Mapped[int | None] = mapped_column(Integer)
    context_len: Mapped[int] = mapped_column(Integer, default=0)
    context_digest: Mapped[str | None] = mapped_column(String(64))
    row: Mapped[dict[str, Any]] = mapped_column(JSON)
    row_digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
