"""Every statement of the storage layer outside the ingest hot path, each a named builder.

procrastinate's named-query discipline in SQLAlchemy Core: a storage room (``core``,
``lineage``, ``lifecycle``, ``audit``) or a Gym module (``gym_store``, ``custody``,
``audit_views``) never assembles SQL itself; it calls the builder whose one-line docstring says
what the statement answers or changes, and executes what it gets.  A builder only builds (no
I/O, no clock except where its docstring says so); where SQLite and Postgres spell a piece
differently it takes the engine's :class:`~ledger.storage.dialect.SqlDialect`.  The ingest hot
path's plain SQL is named in ``ledger.storage.statements``.

Tables go by their SQL names (``rollouts``, ``calls``, ``call_tokens``, …).  The module is
long on purpose (over 600 lines): its length is the number of statements, one short builder
each, grouped by room under banners, and one module is the one place to look for any of them.
``capture`` and ``snapshot`` still build their rarer statements inline; they move here next.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa

from ledger.storage.dialect import SqlDialect
from ledger.tables import (
    Call,
    CallTokens,
    CustodyRow,
    Delivery,
    IncompleteEvent,
    LineageEdge,
    QuarantineRow,
    Rollout,
    utcnow,
)

rollouts = cast(sa.Table, Rollout.__table__)
calls = cast(sa.Table, Call.__table__)
call_tokens = cast(sa.Table, CallTokens.__table__)
lineage_edges = cast(sa.Table, LineageEdge.__table__)
quarantines = cast(sa.Table, QuarantineRow.__table__)
incomplete_events = cast(sa.Table, IncompleteEvent.__table__)
deliveries = cast(sa.Table, Delivery.__table__)
custody_rows = cast(sa.Table, CustodyRow.__table__)

# A latest build masked from the loss: masked by the builder, or failed.
MASKED_OUTCOMES = ("masked", "failed")

# ----------------------------------------------------------------------------- rollout row


def create_rollout(sql: SqlDialect, rollout_id: str) -> Any:
    """Create the rollout's open row (nothing when it exists)."""
    return sql.insert_or_skip(
        rollouts,
        ["rollout_id"],
        rollout_id=rollout_id,
        state="open",
        incomplete=False,
        version=0,
    )


def rollout_head(rollout_id: str) -> sa.Select[Any]:
    """The rollout's state, incomplete flag, snapshot id and version (no row: unknown)."""
    return sa.select(
        rollouts.c.state, rollouts.c.incomplete, rollouts.c.snapshot_id, rollouts.c.version
    ).where(rollouts.c.rollout_id == rollout_id)


def rollout_state(rollout_id: str) -> sa.Select[Any]:
    """The rollout's state alone (no row: unknown)."""
    return sa.select(rollouts.c.state).where(rollouts.c.rollout_id == rollout_id)


def bump_version(rollout_id: str, **values: Any) -> Any:
    """Bump the rollout's version (stamping ``updated_at`` now, and ``values``); returns it."""
    return (
        rollouts.update()
        .where(rollouts.c.rollout_id == rollout_id)
        .values(version=rollouts.c.version + 1, updated_at=utcnow(), **values)
        .returning(rollouts.c.version)
    )


def add_incomplete_event(rollout_id: str, model_call_id: str, reason: str, detail: str) -> Any:
    """Store why a rollout is incomplete."""
    return incomplete_events.insert().values(
        rollout_id=rollout_id, model_call_id=model_call_id, reason=reason, detail=detail
    )


def delete_rollout(rollout_id: str) -> Any:
    """Remove the rollout and, by cascade, every row that belongs to it."""
    return rollouts.delete().where(rollouts.c.rollout_id == rollout_id)


def delete_retired_tombstones(cutoff: datetime) -> Any:
    """Remove the tombstones of rollouts retired at or before ``cutoff``."""
    return rollouts.delete().where(rollouts.c.state == "retired", rollouts.c.retired_at <= cutoff)


# ----------------------------------------------------------------------------- retire


def retire_consumed(rollout_id: str, snapshot_id: str, version: int, now: datetime) -> Any:
    """Retire the rollout if it is frozen at exactly this snapshot and version; no row: not so.

    The conditional retire: it returns the rollout's incomplete flag when it retired it.
    """
    return (
        rollouts.update()
        .where(
            rollouts.c.rollout_id == rollout_id,
            rollouts.c.state == "frozen",
            rollouts.c.snapshot_id == snapshot_id,
            rollouts.c.version == version,
        )
        .values(state="retired", retired_at=now, updated_at=now)
        .returning(rollouts.c.incomplete)
    )


def delete_rollout_tokens(rollout_id: str) -> Any:
    """Delete the packed token arrays of every call of the rollout (its payloads)."""
    return call_tokens.delete().where(
        call_tokens.c.call_id.in_(sa.select(calls.c.id).where(calls.c.rollout_id == rollout_id))
    )


def retire_deliveries(rollout_id: str, snapshot_id: str, version: int, now: datetime) -> Any:
    """Stamp the delivered builds of this snapshot and version as retired."""
    return (
        deliveries.update()
        .where(
            deliveries.c.rollout_id == rollout_id,
            deliveries.c.snapshot_id == snapshot_id,
            deliveries.c.version == version,
            deliveries.c.outcome == "delivered",
        )
        .values(retired_at=now)
    )


# ----------------------------------------------------------------------------- deliveries


def delivery_by_key(idempotency_key: str) -> sa.Select[Any]:
    """The id of the delivery stored under this idempotency key, if any."""
    return sa.select(deliveries.c.id).where(deliveries.c.idempotency_key == idempotency_key)


def insert_delivery(**values: Any) -> Any:
    """Store one build of a snapshot; returns its delivery id."""
    return deliveries.insert().values(**values).returning(deliveries.c.id)


def insert_quarantines() -> Any:
    """Store quarantine rows (executed with one parameter set per row)."""
    return quarantines.insert()


def stamp_delivery(delivery_id: int, **stamps: Any) -> Any:
    """Set a delivery's stamps (``handed_off_at``, ``durable_ack_at``); rowcount 0: unknown."""
    return deliveries.update().where(deliveries.c.id == delivery_id).values(**stamps)


# ----------------------------------------------------------------------------- lineage


def _captured() -> sa.ColumnElement[bool]:
    """The condition ``status = 'captured'``, with the status written as a constant.

    The calls' partial indexes on captured calls (migration 0005) serve only a query that names
    the status literally, not one that binds it as a parameter."""
    return calls.c.status == sa.literal_column("'captured'")


def _parent_candidate(rollout_id: str) -> list[Any]:
    """A captured call of the rollout that could be a parent (its generation is not empty).

    An empty generation's cumulative tokens are its prompt: it would become the parent of its
    own retry.
    """
    return [
        calls.c.rollout_id == rollout_id,
        _captured(),
        calls.c.generation_len > 0,
    ]


def parent_candidate_lengths(rollout_id: str, upper: int, batch: int) -> sa.Select[Any]:
    """The distinct cumulative lengths of parent candidates up to ``upper``, longest first."""
    return (
        sa.select(calls.c.cumulative_len)
        .where(*_parent_candidate(rollout_id), calls.c.cumulative_len <= upper)
        .group_by(calls.c.cumulative_len)
        .order_by(calls.c.cumulative_len.desc())
        .limit(batch)
    )


def parent_candidates_matching(rollout_id: str, digests: Mapping[int, str]) -> sa.Select[Any]:
    """Parent candidates whose cumulative digest is the prompt's prefix digest at their length.

    ``digests`` maps a length to the digest of the prompt's first that many tokens; longest
    first, then by call id.
    """
    match = sa.or_(
        *(
            sa.and_(calls.c.cumulative_len == n, calls.c.cumulative_digest == digest)
            for n, digest in digests.items()
        )
    )
    return (
        sa.select(calls.c.id, calls.c.model_call_id, calls.c.cumulative_len, calls.c.generation_len)
        .where(*_parent_candidate(rollout_id), match)
        .order_by(calls.c.cumulative_len.desc(), calls.c.model_call_id)
    )


def generation_ids(call_pk: int) -> sa.Select[Any]:
    """A call's stored generated ids and their codec (no row: its payload was deleted)."""
    return sa.select(call_tokens.c.generation_ids, call_tokens.c.ids_codec).where(
        call_tokens.c.call_id == call_pk
    )


def ancestry_to_anchor(rollout_id: str, model_call_id: str) -> sa.Select[Any]:
    """A call and its ancestors up to the nearest full-prompt record, with their ids, root first.

    One recursive query; the walk stops at the first record that stores its whole prompt (the
    anchor a delta chain is rebuilt from).
    """
    start = sa.select(
        calls.c.id, calls.c.parent_call_id, calls.c.prompt_is_delta, sa.literal(0).label("depth")
    ).where(calls.c.rollout_id == rollout_id, calls.c.model_call_id == model_call_id)
    chain = start.cte("chain", recursive=True)
    parent = calls.alias("p")
    step = sa.select(
        parent.c.id, parent.c.parent_call_id, parent.c.prompt_is_delta, chain.c.depth + 1
    ).where(
        parent.c.rollout_id == rollout_id,
        parent.c.model_call_id == chain.c.parent_call_id,
        chain.c.depth < 1_000_000,
        chain.c.prompt_is_delta,
    )
    chain = chain.union_all(step)
    return (
        sa.select(
            calls.c.prompt_is_delta,
            calls.c.cumulative_digest,
            call_tokens.c.ids_codec,
            call_tokens.c.prompt_ids,
            call_tokens.c.generation_ids,
        )
        .select_from(
            chain.join(calls, calls.c.id == chain.c.id).join(
                call_tokens, call_tokens.c.call_id == calls.c.id
            )
        )
        .order_by(chain.c.depth.desc())
    )


def continuation_candidates(rollout_id: str, fingerprint: str) -> sa.Select[Any]:
    """Captured calls of the rollout stamped with this continuation fingerprint, by call id."""
    return (
        sa.select(
            calls.c.model_call_id,
            calls.c.cumulative_len,
            calls.c.cumulative_digest,
            calls.c.generation_len,
            calls.c.extra,
        )
        .where(
            calls.c.rollout_id == rollout_id,
            _captured(),
            calls.c.continuation_fingerprint == fingerprint,
        )
        .order_by(calls.c.model_call_id)
    )


# ----------------------------------------------------------------------------- Gym lineage


def gym_stamped_calls(rollout_id: str, fingerprint: str) -> sa.Select[Any]:
    """Captured calls whose Gym extra fields carry this continuation fingerprint."""
    stamped = calls.c.extra["continuation_fingerprint"].as_string()
    return sa.select(calls.c.model_call_id, calls.c.cumulative_len, calls.c.extra).where(
        calls.c.rollout_id == rollout_id, _captured(), stamped == fingerprint
    )


def reused_call_ids(rollout_id: str) -> sa.Select[Any]:
    """Call ids of the rollout whose put was refused as a conflicting payload (reused ids)."""
    return sa.select(incomplete_events.c.model_call_id).where(
        incomplete_events.c.rollout_id == rollout_id,
        incomplete_events.c.reason == "conflicting_payload",
    )


# ----------------------------------------------------------------------------- custody rows


def committed_custody_digest(rollout_id: str, model_call_id: str) -> sa.Select[Any]:
    """The row digest of the call's committed custody row, if any."""
    return sa.select(custody_rows.c.row_digest).where(
        custody_rows.c.rollout_id == rollout_id,
        custody_rows.c.model_call_id == model_call_id,
        custody_rows.c.failure_reason == "",
    )


def insert_custody_row(**values: Any) -> Any:
    """Store one custody row."""
    return custody_rows.insert().values(**values)


def insert_custody_failure(sql: SqlDialect, **values: Any) -> Any:
    """Store a poison custody row, once per call and reason (a repeat changes nothing)."""
    return sql.insert_or_skip(
        custody_rows, ["rollout_id", "model_call_id", "failure_reason"], **values
    )


def custody_manifest_rows(rollout_id: str) -> sa.Select[Any]:
    """Every custody row of the rollout (committed or failed), in the order they were stored."""
    return _rows_of_rollout(
        custody_rows,
        rollout_id,
        custody_rows.c.model_call_id,
        custody_rows.c.failure_reason,
        custody_rows.c.row,
    )


def any_custody_row(rollout_id: str) -> sa.Select[Any]:
    """One custody row id of the rollout, if it has any."""
    return sa.select(custody_rows.c.id).where(custody_rows.c.rollout_id == rollout_id).limit(1)


def custody_candidates(rollout_id: str, fingerprint: str, version: int) -> sa.Select[Any]:
    """Committed custody rows stamped with this fingerprint under this fingerprint version."""
    return sa.select(
        custody_rows.c.context_len, custody_rows.c.context_digest, custody_rows.c.row
    ).where(
        custody_rows.c.rollout_id == rollout_id,
        custody_rows.c.fingerprint == fingerprint,
        custody_rows.c.fingerprint_version == version,
        custody_rows.c.failure_reason == "",
    )


# ----------------------------------------------------------------------------- audit: one rollout


def _rows_of_rollout(table: sa.Table, rollout_id: str, *columns: Any) -> sa.Select[Any]:
    """``columns`` of the rows of ``table`` that belong to the rollout, in the order stored."""
    return sa.select(*columns).where(table.c.rollout_id == rollout_id).order_by(table.c.id)


def rollout_row(rollout_id: str) -> sa.Select[Any]:
    """The rollout's whole row."""
    return sa.select(rollouts).where(rollouts.c.rollout_id == rollout_id)


def rollout_calls(rollout_id: str) -> sa.Select[Any]:
    """The rollout's calls (metadata, whether their tokens are still stored), in order."""
    return _rows_of_rollout(
        calls,
        rollout_id,
        calls.c.id,
        calls.c.model_call_id,
        calls.c.status,
        calls.c.model,
        calls.c.route,
        calls.c.response_id,
        calls.c.prompt_len,
        calls.c.generation_len,
        calls.c.cumulative_len,
        calls.c.parent_call_id,
        calls.c.prompt_is_delta,
        calls.c.created_at,
        calls.c.registered_at,
        calls.c.recorded_at,
        sa.exists().where(call_tokens.c.call_id == calls.c.id).label("has_tokens"),
    )


def rollout_edges(rollout_id: str) -> sa.Select[Any]:
    """The rollout's lineage edges by child and parent call id, in order."""
    parent_call = calls.alias("parent")
    child_call = calls.alias("child")
    return (
        _rows_of_rollout(
            lineage_edges,
            rollout_id,
            child_call.c.model_call_id.label("child"),
            parent_call.c.model_call_id.label("parent"),
            lineage_edges.c.method,
            lineage_edges.c.status,
            lineage_edges.c.shared_len,
            lineage_edges.c.mismatch_pos,
            lineage_edges.c.mismatch_kind,
        )
        .join(child_call, child_call.c.id == lineage_edges.c.child_id)
        .join(parent_call, parent_call.c.id == lineage_edges.c.parent_id)
    )


def rollout_quarantines(rollout_id: str) -> sa.Select[Any]:
    """The rollout's quarantined calls, per delivery, in order."""
    return _rows_of_rollout(
        quarantines,
        rollout_id,
        quarantines.c.delivery_id,
        quarantines.c.model_call_id,
        quarantines.c.reason,
        quarantines.c.detail,
        quarantines.c.created_at,
    )


def rollout_incomplete_events(rollout_id: str) -> sa.Select[Any]:
    """Why the rollout is incomplete, event by event, in order."""
    return _rows_of_rollout(
        incomplete_events,
        rollout_id,
        incomplete_events.c.model_call_id,
        incomplete_events.c.reason,
        incomplete_events.c.detail,
        incomplete_events.c.created_at,
    )


def rollout_deliveries(rollout_id: str) -> sa.Select[Any]:
    """Every build of the rollout (whole delivery rows), in order."""
    return _rows_of_rollout(deliveries, rollout_id, deliveries)


# ----------------------------------------------------------------------------- audit: listings


def latest_build(since: datetime | None = None) -> Any:
    """Each rollout's latest build id (among builds since ``since``): a subquery.

    Its columns: ``rollout_id`` and ``did`` (the highest delivery id).
    """
    query = sa.select(deliveries.c.rollout_id, sa.func.max(deliveries.c.id).label("did"))
    if since is not None:
        query = query.where(deliveries.c.built_at >= since)
    return query.group_by(deliveries.c.rollout_id).subquery("latest")


def rollouts_with_latest_build(*columns: Any) -> sa.Select[Any]:
    """Every rollout with its call count and its latest build: the audit listings' base.

    Its columns: the rollout's row, ``n_calls`` (captured calls), the latest build's outcome,
    mask reasons and ``columns`` (NULL for a rollout never built).
    """
    latest = latest_build()
    n_calls = (
        sa.select(sa.func.count())
        .where(calls.c.rollout_id == rollouts.c.rollout_id, calls.c.status == "captured")
        .scalar_subquery()
    )
    return sa.select(
        rollouts.c.rollout_id,
        rollouts.c.state,
        rollouts.c.incomplete,
        rollouts.c.version,
        rollouts.c.created_at,
        rollouts.c.updated_at,
        n_calls.label("n_calls"),
        deliveries.c.outcome,
        deliveries.c.mask_reasons,
        *columns,
    ).select_from(
        rollouts.outerjoin(latest, latest.c.rollout_id == rollouts.c.rollout_id).outerjoin(
            deliveries, deliveries.c.id == latest.c.did
        )
    )


def _listing_filters(
    query: sa.Select[Any],
    *,
    state: str | None,
    outcomes: Sequence[str] | None,
    updated_since: datetime | None,
) -> sa.Select[Any]:
    """``query`` narrowed by the filters both audit listings share.

    The rollout's state, its latest build's outcome among ``outcomes``, a change at or after
    ``updated_since``.
    """
    if state:
        query = query.where(rollouts.c.state == state)
    if outcomes is not None:
        query = query.where(deliveries.c.outcome.in_(tuple(outcomes)))
    if updated_since is not None:
        query = query.where(rollouts.c.updated_at >= updated_since)
    return query


def audit_rollouts(
    sql: SqlDialect,
    *,
    state: str | None,
    outcome: str | None,
    masked: bool | None,
    reason: str | None,
    since: datetime | None,
    after_id: str | None,
    limit: int,
) -> sa.Select[Any]:
    """The audit API's rollout listing: by id after ``after_id``, filtered, ``limit`` rows.

    Each row carries its latest build's metrics; ``reason`` is a mask reason or a cause behind
    ``capture_incomplete``.
    """
    query = rollouts_with_latest_build(deliveries.c.metrics).order_by(rollouts.c.rollout_id)
    if outcome:
        query = query.where(deliveries.c.outcome == outcome)
    if masked is not None:
        wanted: Sequence[str] | None = MASKED_OUTCOMES if masked else ("delivered",)
    else:
        wanted = None
    query = _listing_filters(query, state=state, outcomes=wanted, updated_since=since)
    if reason:
        query = query.where(build_names_reason(sql, reason))
    if after_id:
        query = query.where(rollouts.c.rollout_id > after_id)
    return query.limit(limit)


def build_names_reason(sql: SqlDialect, reason: str) -> Any:
    """The latest build names ``reason`` as a mask reason or as an incomplete cause.

    An exact element of ``mask_reasons`` or of ``metrics.incomplete_reasons`` (the causes
    behind ``capture_incomplete``).
    """
    return sa.or_(
        sql.json_array_holds(deliveries.c.mask_reasons, reason),
        sql.json_array_holds(deliveries.c.metrics, reason, "$.incomplete_reasons"),
    )


def page_rollouts(
    sql: SqlDialect,
    *,
    state: str | None,
    outcome: str | None,
    reason: str | None,
    consumer: str | None,
    since: datetime | None,
    until: datetime | None,
    id_prefix: str | None,
    before: tuple[datetime, str] | None,
    limit: int,
) -> sa.Select[Any]:
    """The audit page's rollout listing: latest change first, before ``before``, filtered.

    ``before`` is the cursor (a change time and a rollout id); each row carries its latest
    build's consumer and time.  ``outcome`` ``none`` is never built, and ``masked`` includes
    failed; ``reason`` is a mask reason, an incomplete event's or a quarantine's; ``limit``
    rows at most.
    """
    query = rollouts_with_latest_build(deliveries.c.consumer, deliveries.c.built_at).order_by(
        rollouts.c.updated_at.desc(), rollouts.c.rollout_id.desc()
    )
    wanted: Sequence[str] | None = None
    if outcome == "none":
        query = query.where(deliveries.c.id.is_(None))
    elif outcome:
        wanted = MASKED_OUTCOMES if outcome == "masked" else (outcome,)
    query = _listing_filters(query, state=state, outcomes=wanted, updated_since=since)
    if reason:
        query = query.where(
            sa.or_(
                sql.json_array_holds(deliveries.c.mask_reasons, reason),
                sa.exists().where(
                    incomplete_events.c.rollout_id == rollouts.c.rollout_id,
                    incomplete_events.c.reason == reason,
                ),
                sa.exists().where(
                    quarantines.c.rollout_id == rollouts.c.rollout_id,
                    quarantines.c.reason == reason,
                ),
            )
        )
    if consumer:
        query = query.where(deliveries.c.consumer == consumer)
    if until is not None:
        query = query.where(rollouts.c.updated_at < until)
    if id_prefix:
        query = query.where(rollouts.c.rollout_id.startswith(id_prefix, autoescape=True))
    if before is not None:
        at, rollout_id = before
        query = query.where(
            sa.or_(
                rollouts.c.updated_at < at,
                sa.and_(rollouts.c.updated_at == at, rollouts.c.rollout_id < rollout_id),
            )
        )
    return query.limit(limit)


def incomplete_causes(rollout_ids: Sequence[str]) -> sa.Select[Any]:
    """The distinct incomplete-event reasons of these rollouts, each in order of first event."""
    return (
        sa.select(incomplete_events.c.rollout_id, incomplete_events.c.reason)
        .where(incomplete_events.c.rollout_id.in_(list(rollout_ids)))
        .group_by(incomplete_events.c.rollout_id, incomplete_events.c.reason)
        .order_by(incomplete_events.c.rollout_id, sa.func.min(incomplete_events.c.id))
    )


# ----------------------------------------------------------------------------- audit: counts


def rollouts_by_state(updated_since: datetime | None = None) -> sa.Select[Any]:
    """How many rollouts are in each state (changed at or after ``updated_since``)."""
    query = sa.select(rollouts.c.state, sa.func.count()).group_by(rollouts.c.state)
    if updated_since is not None:
        query = query.where(rollouts.c.updated_at >= updated_since)
    return query


def latest_builds(built_since: datetime | None = None) -> sa.Select[Any]:
    """Each rollout's latest build (outcome, mask reasons, metrics), if built since then."""
    latest = latest_build()
    query = sa.select(deliveries.c.outcome, deliveries.c.mask_reasons, deliveries.c.metrics).join(
        latest, latest.c.did == deliveries.c.id
    )
    if built_since is not None:
        query = query.where(deliveries.c.built_at >= built_since)
    return query


def incomplete_events_by_reason(
    window: tuple[datetime, datetime] | None = None,
) -> sa.Select[Any]:
    """How many incomplete events each reason has (only those in ``window``, ends included)."""
    query = sa.select(incomplete_events.c.reason, sa.func.count())
    if window is not None:
        since, until = window
        query = query.where(
            incomplete_events.c.created_at >= since, incomplete_events.c.created_at <= until
        )
    return query.group_by(incomplete_events.c.reason)


def _bucket(sql: SqlDialect, column: Any, start: datetime, bucket_s: int) -> Any:
    """``floor((column - start) / bucket_s)``, labelled ``b``.

    The two integers are inlined (not bound) so that Postgres sees the same expression in the
    select list and in GROUP BY.
    """
    first = sa.literal_column(str(int(start.timestamp())), sa.BigInteger)
    width = sa.literal_column(str(int(bucket_s)), sa.BigInteger)
    return ((sql.epoch_seconds(column) - first) // width).label("b")


def captured_per_bucket(
    sql: SqlDialect, start: datetime, bucket_s: int, since: datetime, until: datetime
) -> sa.Select[Any]:
    """Calls captured in [since, until], counted per time bucket (bucket ``b`` from ``start``)."""
    bucket = _bucket(sql, calls.c.recorded_at, start, bucket_s)
    return (
        sa.select(bucket, sa.func.count())
        .where(
            calls.c.status == "captured",
            calls.c.recorded_at >= since,
            calls.c.recorded_at <= until,
        )
        .group_by(bucket)
    )


def started_per_bucket(
    sql: SqlDialect, start: datetime, bucket_s: int, since: datetime, until: datetime
) -> sa.Select[Any]:
    """Rollouts created in [since, until], counted per time bucket."""
    bucket = _bucket(sql, rollouts.c.created_at, start, bucket_s)
    return (
        sa.select(bucket, sa.func.count())
        .where(rollouts.c.created_at >= since, rollouts.c.created_at <= until)
        .group_by(bucket)
    )


def builds_per_bucket(
    sql: SqlDialect, start: datetime, bucket_s: int, since: datetime, until: datetime
) -> sa.Select[Any]:
    """Latest builds in [since, until], counted per time bucket, outcome, reasons and consumer.

    Latest among the builds since ``since``: the window ends now, so that is the latest build.
    """
    latest = latest_build(since)
    bucket = _bucket(sql, deliveries.c.built_at, start, bucket_s)
    return (
        sa.select(
            bucket,
            deliveries.c.outcome,
            deliveries.c.mask_reasons,
            deliveries.c.consumer,
            sa.func.count(),
        )
        .join(latest, latest.c.did == deliveries.c.id)
        .where(deliveries.c.built_at >= since, deliveries.c.built_at <= until)
        .group_by(bucket, deliveries.c.outcome, deliveries.c.mask_reasons, deliveries.c.consumer)
    )


# ----------------------------------------------------------------------------- capture and freeze


def update_open_intent(rollout_id: str, model_call_id: str, **values: Any) -> Any:
    """Set ``values`` on the call's row while it is still an open intent."""
    return (
        calls.update()
        .where(
            calls.c.rollout_id == rollout_id,
            calls.c.model_call_id == model_call_id,
            calls.c.status == "intent",
        )
        .values(**values)
    )


def open_intents(rollout_id: str) -> sa.Select[Any]:
    """The rollout's calls still open as intents (id and notes): dangling at freeze."""
    return sa.select(calls.c.model_call_id, calls.c.extra).where(
        calls.c.rollout_id == rollout_id, calls.c.status == "intent"
    )


def captured_calls_with_tokens(rollout_id: str) -> sa.Select[Any]:
    """The rollout's captured calls joined with their stored tokens, in arrival order."""
    return (
        sa.select(calls, call_tokens)
        .join(call_tokens, call_tokens.c.call_id == calls.c.id)
        .where(calls.c.rollout_id == rollout_id, calls.c.status == "captured")
        .order_by(calls.c.id)
    )


def calls_noted_incomplete(rollout_id: str, reason: str) -> sa.Select[Any]:
    """The call ids already noted in an incomplete event of the rollout with ``reason``."""
    return sa.select(incomplete_events.c.model_call_id).where(
        incomplete_events.c.rollout_id == rollout_id, incomplete_events.c.reason == reason
    )


def json_text(column: Any) -> Any:
    """A JSON column read as its stored text, labelled as the column.

    For a caller that decodes it with orjson instead of the driver's stdlib decoder."""
    return sa.cast(column, sa.Text()).label(column.key)


def _chain() -> Any:
    """The chain ending at ``:call_id`` in rollout ``:rollout_id``, root first, with its tokens.

    One recursive query walking ``parent_call_id``.  Plain SQL both dialects run as written
    (compiling the recursive CTE from Core cost milliseconds on each engine's first build);
    JSON columns come back as their stored text."""
    c, t = calls.name, call_tokens.name
    return sa.text(
        f"WITH RECURSIVE chain(id, parent_call_id, depth) AS ("
        f"SELECT id, parent_call_id, 0 FROM {c} "
        f"WHERE rollout_id = :rollout_id AND model_call_id = :call_id "
        f"UNION ALL SELECT p.id, p.parent_call_id, chain.depth + 1 FROM {c} AS p, chain "
        f"WHERE p.rollout_id = :rollout_id AND p.model_call_id = chain.parent_call_id "
        f"AND chain.depth < 1000000) "
        f"SELECT k.model_call_id, k.prompt_is_delta, k.cumulative_len, k.cumulative_digest, "
        f"CAST(k.output_items AS TEXT) AS output_items, k.token_item_index, v.ids_codec, "
        f"v.prompt_ids, v.generation_ids, v.log_probs, v.log_prob_codec, "
        f"CAST(v.routed_experts AS TEXT) AS routed_experts "
        f"FROM chain JOIN {c} AS k ON k.id = chain.id JOIN {t} AS v ON v.call_id = k.id "
        f"ORDER BY chain.depth DESC"
    ).bindparams(
        sa.bindparam("rollout_id", type_=sa.String()), sa.bindparam("call_id", type_=sa.String())
    )


def _captured_calls() -> Any:
    """The captured calls of ``:rollout_id`` in arrival order, JSON columns as stored text."""
    json_columns = {"output_items", "extra"}
    columns = [json_text(c) if c.key in json_columns else c for c in calls.c]
    return (
        sa.select(*columns)
        .where(
            calls.c.rollout_id == sa.bindparam("rollout_id", type_=sa.String()),
            calls.c.status == "captured",
        )
        .order_by(calls.c.id)
    )


def _edges_and_reasons() -> Any:
    """The rollout's lineage edges and its distinct incomplete reasons, in one statement.

    Edges come as ``kind`` 0 (in id order), reasons as ``kind`` 1: one round trip fewer inside
    freeze's read.  Plain SQL both dialects run as written (compiling the same union from Core
    costs milliseconds on each engine's first build)."""
    return sa.text(
        f"SELECT 0 AS kind, id AS ord, child_id, parent_id, method, status, shared_len, "
        f"CAST(NULL AS VARCHAR(64)) AS reason FROM {lineage_edges.name} "
        f"WHERE rollout_id = :rollout_id "
        f"UNION ALL SELECT 1, NULL, NULL, NULL, NULL, NULL, NULL, reason FROM "
        f"(SELECT DISTINCT reason FROM {incomplete_events.name} WHERE rollout_id = :rollout_id) "
        f"AS r ORDER BY kind, ord"
    ).bindparams(sa.bindparam("rollout_id", type_=sa.String()))


# Built once (only their parameters change): the build path's three reads.
CHAIN = _chain()
CAPTURED_CALLS = _captured_calls()
EDGES_AND_REASONS = _edges_and_reasons()
