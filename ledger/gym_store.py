"""The ledger's read operations for NeMo Gym 0.7.0's lineage protocol (SQL for ``ledger.gym``).

Two named operations over one ``Ledger``, each in one read transaction:

- ``resolve_request(ledger, rollout_id, request_items)``: 0.7.0's ``LineageResolver.resolve``
  (the rule is in ``ledger.gym_lineage``).  Candidates are found in SQL by the continuation
  fingerprint each record was stamped with (kept with the record's extra fields); only the
  winner's tokens are read, through the ledger's own delta chain, and checked against both the
  ledger's cumulative digest and the record's Gym ``digest``.
  When no token record resolves the request, a ``CaptureLedger`` custody row may
  (``ledger.custody.custody_match``), as 0.7.0's ``FileLineageStore`` falls back to its rows.
- ``materialize_delta(ledger, entry)``: a Gym delta record (``prompt_is_delta``, its prompt only
  the suffix after its resolved parent) with its full prompt, so the ledger's token-prefix proof
  at ingest sees the real prompt.  The parent's stored cumulative tokens plus the suffix must
  reproduce the record's ``cum_len`` and ``digest``; otherwise the record is refused.

A call id whose put was refused as a conflicting payload is never a candidate: the ledger keeps
the first record, but a resolver must not build on an id that was reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ledger import codec
from ledger.custody import custody_match
from ledger.errors import InvalidRecord, LedgerError
from ledger.gym_fingerprint import assistant_fingerprint
from ledger.gym_lineage import LineageCandidate, LineageMatch, LineageResolution, choose_parent
from ledger.ids import validate_rollout_id
from ledger.records import ParentResolutionStatus, TokenEntry, gym_token_digest
from ledger.store import Ledger
from ledger.tables import Call, IncompleteEvent, Rollout

__all__ = ["materialize_delta", "resolve_request"]

R = cast(sa.Table, Rollout.__table__)
C = cast(sa.Table, Call.__table__)
IE = cast(sa.Table, IncompleteEvent.__table__)

UNRESOLVED = ParentResolutionStatus.UNRESOLVED


async def resolve_request(
    ledger: Ledger, rollout_id: str, request_items: Sequence[Any]
) -> LineageResolution:
    """0.7.0's request-time parent decision over every committed record; never guesses."""
    validate_rollout_id(rollout_id)
    items = list(request_items)
    try:
        fingerprint = assistant_fingerprint(items)
    except (ValueError, TypeError, AttributeError) as exc:
        return LineageResolution(UNRESOLVED, reason=f"invalid_request_items: {exc}")
    if not fingerprint:
        return LineageResolution(ParentResolutionStatus.ROOT)

    def lookup(conn: Connection) -> LineageResolution:
        state = conn.execute(
            sa.select(R.c.state).where(R.c.rollout_id == rollout_id)
        ).scalar_one_or_none()
        if state == "retired":
            return LineageResolution(UNRESOLVED, reason="rollout_retired")
        try:
            status, winner, reason = choose_parent(
                items, _candidates(conn, rollout_id, fingerprint)
            )
        except (ValueError, TypeError, AttributeError) as exc:
            return LineageResolution(UNRESOLVED, reason=f"invalid_request_items: {exc}")
        if winner is None:
            if status == UNRESOLVED:  # a CaptureLedger custody row may still prove the parent
                match = custody_match(conn, rollout_id, fingerprint, items)
                if match is not None:
                    return LineageResolution(ParentResolutionStatus.RESOLVED, match)
            return LineageResolution(status, reason=reason)
        try:
            data = ledger._cumulative_bytes(conn, rollout_id, winner.model_call_id)
        except InvalidRecord as exc:
            return LineageResolution(UNRESOLVED, reason=f"parent_unreconstructable: {exc}")
        tokens = codec.unpack_ids(data)
        try:
            digest = gym_token_digest(tokens)
        except ValueError as exc:  # a negative id: outside what the Gym digest can describe
            return LineageResolution(UNRESOLVED, reason=f"parent_unreconstructable: {exc}")
        if winner.digest and winner.digest != digest:
            return LineageResolution(
                UNRESOLVED, reason="parent_unreconstructable: tokens fail the record's digest"
            )
        return LineageResolution(
            ParentResolutionStatus.RESOLVED,
            LineageMatch(winner.model_call_id, tuple(tokens), digest, prev_len=len(tokens)),
        )

    async with ledger._read() as aconn:
        return await aconn.run_sync(lookup)


def _candidates(conn: Connection, rollout_id: str, fingerprint: str) -> list[LineageCandidate]:
    stamped = C.c.extra["continuation_fingerprint"].as_string()
    rows = conn.execute(
        sa.select(C.c.model_call_id, C.c.cumulative_len, C.c.extra).where(
            C.c.rollout_id == rollout_id, C.c.status == "captured", stamped == fingerprint
        )
    ).all()
    if not rows:
        return []
    reused = set(
        conn.execute(
            sa.select(IE.c.model_call_id).where(
                IE.c.rollout_id == rollout_id, IE.c.reason == "conflicting_payload"
            )
        ).scalars()
    )
    out = []
    for r in rows:
        extra = r.extra or {}
        if r.model_call_id in reused or extra.get("continuation_fingerprint") != fingerprint:
            continue
        cum_len = extra.get("cum_len")
        out.append(
            LineageCandidate(
                model_call_id=r.model_call_id,
                cum_len=int(cum_len) if cum_len is not None else int(r.cumulative_len),
                digest=str(extra.get("digest") or ""),
                context_len=int(extra.get("continuation_context_len") or 0),
                context_digest=str(extra.get("continuation_context_digest") or ""),
                fingerprint_version=extra.get("fingerprint_version"),
            )
        )
    return out


async def materialize_delta(ledger: Ledger, entry: TokenEntry) -> TokenEntry:
    """``entry`` with its full prompt (its resolved parent's cumulative tokens + its suffix)."""
    parent = entry.parent_call_id
    if not entry.prompt_is_delta or parent is None:
        return entry
    rid = entry.rollout_id

    def read(conn: Connection) -> bytes:
        return ledger._cumulative_bytes(conn, rid, parent)

    try:
        async with ledger._read() as aconn:
            base = codec.unpack_ids(await aconn.run_sync(read))
    except LedgerError as exc:
        raise InvalidRecord(
            f"delta record {entry.model_call_id!r} cannot be reconstructed through its parent "
            f"{parent!r}: {exc}",
            rollout_id=rid,
        ) from None
    prompt = [*base, *entry.prompt_token_ids]
    full = [*prompt, *entry.generation_token_ids]
    if (entry.cum_len is not None and entry.cum_len != len(full)) or (
        entry.digest and gym_token_digest(full) != entry.digest
    ):
        raise InvalidRecord(
            f"delta record {entry.model_call_id!r}: its parent {parent!r} plus its suffix do not "
            "reproduce its cum_len/digest",
            rollout_id=rid,
        )
    return entry.model_copy(update={"prompt_token_ids": prompt})
