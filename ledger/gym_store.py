"""The ledger's read operations for NeMo Gym 0.7.0's lineage protocol (SQL for ``ledger.gym``).

The named read operation over one ``Ledger``, in one read transaction:

- ``resolve_request(ledger, rollout_id, request_items)``: 0.7.0's ``LineageResolver.resolve``
  (the rule is in ``ledger.gym_lineage``).  Candidates are found in SQL by the continuation
  fingerprint each record was stamped with (kept with the record's extra fields); only the
  winner's tokens are read, through the ledger's own delta chain, and checked against both the
  ledger's cumulative digest and the record's Gym ``digest``.
  When no token record resolves the request, a ``CaptureLedger`` custody row may
  (``ledger.custody.custody_match``), as 0.7.0's ``FileLineageStore`` falls back to its rows.

Gym delta records are made whole at ingest by ``ledger.gym_delta`` (``Ledger.put`` calls it).

A call id whose put was refused as a conflicting payload is never a candidate: the ledger keeps
the first record, but a resolver must not build on an id that was reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from ledger import codec
from ledger.custody import custody_match
from ledger.errors import InvalidRecord
from ledger.gym_fingerprint import assistant_fingerprint
from ledger.gym_lineage import LineageCandidate, LineageMatch, LineageResolution, choose_parent
from ledger.ids import validate_rollout_id
from ledger.records import ParentResolutionStatus, gym_token_digest
from ledger.storage import queries
from ledger.store import Ledger

__all__ = ["resolve_request"]

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
        state = conn.execute(queries.rollout_state(rollout_id)).scalar_one_or_none()
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
    rows = conn.execute(queries.gym_stamped_calls(rollout_id, fingerprint)).all()
    if not rows:
        return []
    reused = set(conn.execute(queries.reused_call_ids(rollout_id)).scalars())
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
