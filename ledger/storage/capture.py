"""The capture writes: intents, cancels, failed attempts, records (``put``) and incomplete marks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Connection

from ledger.errors import (
    RolloutRetired,
)
from ledger.gym_delta import materialize_delta
from ledger.ids import validate_call_id, validate_rollout_id
from ledger.records import TokenEntry, coerce_entry
from ledger.storage import ingest, queries
from ledger.storage.core import (
    _OFFLOAD_DELTA_TOKENS,
    _OFFLOAD_TOKENS,
    _storable_call_id,
    _validate_reason,
)
from ledger.storage.lineage import LineageOps
from ledger.storage.results import (
    PutResult,
)


class CaptureOps(LineageOps):
    """Capture writes (a mixin of ``Ledger``)."""

    async def begin_call(
        self, rollout_id: str, model_call_id: str, *, route: str | None = None, model: str = ""
    ) -> bool:
        """Durably record a pre-dispatch intent (§4.6); refused after freeze or retire.

        Returns False when the call id was already registered (an idempotent repeat)."""
        validate_rollout_id(rollout_id)
        validate_call_id(model_call_id)

        now = self._now()
        pk: int | None = await self._run_steps(
            lambda folded: ingest.begin_call_steps(
                rollout_id, model_call_id, route, model or "", now, folded=folded
            ),
            flush=self.flush_intents,
            single=True,
        )
        if pk is not None and self.sql.optimistic_records:
            self._heads.note_intent(rollout_id, model_call_id, pk)
        return pk is not None

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> bool:
        """Close an intent for a call that ended without generating; True if one was open."""
        validate_rollout_id(rollout_id)
        validate_call_id(model_call_id)
        return await self._update_open_intent(
            rollout_id, model_call_id, "cancel_call", status="cancelled"
        )

    async def note_failed_attempt(
        self, rollout_id: str, model_call_id: str, *, reason: str, detail: str, retry_key: str
    ) -> bool:
        """Keep an intent whose upstream attempt produced no output open, for a retry to settle.

        A successful retry with the same ``retry_key`` cancels it
        (:meth:`settle_failed_attempts`); at freeze an unsettled one is a lost call: the rollout
        is incomplete with ``reason``.  True if an open intent was noted."""
        validate_rollout_id(rollout_id)
        validate_call_id(model_call_id)
        _validate_reason(reason)
        note = {"failed_attempt": {"reason": reason, "detail": detail, "retry_key": retry_key}}
        return await self._update_open_intent(
            rollout_id, model_call_id, "note_failed_attempt", extra=note
        )

    async def settle_failed_attempts(self, rollout_id: str, retry_key: str) -> list[str]:
        """Cancel the open failed attempts a successful retry with ``retry_key`` replaced (they
        produced nothing the harness saw); returns their call ids.

        ``put(settle_retry_key=...)`` does the same inside the record's own transaction; this
        is for a successful retry whose record was not stored."""
        validate_rollout_id(rollout_id)
        settled: tuple[str, ...] = await self._run_steps(
            lambda folded: ingest.settle_steps(rollout_id, retry_key, folded=folded)
        )
        return list(settled)

    async def _update_open_intent(
        self, rollout_id: str, model_call_id: str, what: str, **values: Any
    ) -> bool:
        """Set ``values`` on the call's open intent (refused once the rollout is closed); True if
        one was open."""

        def body(conn: Connection) -> bool:
            state = self._lock_rollout(conn, rollout_id)
            self._refuse_if_closed(state, what)
            res = conn.execute(queries.update_open_intent(rollout_id, model_call_id, **values))
            return bool(res.rowcount)

        return await self._transact(body)

    async def put(
        self,
        entry: TokenEntry | dict[str, Any],
        *,
        route: str | None = None,
        request_fingerprint: str = "",
        continuation_fingerprint: str = "",
        settle_retry_key: str | None = None,
    ) -> PutResult:
        """Commit one call record with its proven lineage edge before returning (§4.1 to §4.3).

        A byte-identical repeat is a no-op; the same call id with other bytes is refused, marks
        the rollout incomplete and leaves the first record unchanged; a new record after freeze
        or anything after retire is refused.

        ``settle_retry_key``: this record answers a successful retry; in the same transaction
        the rollout's open failed attempts noted with that retry key are cancelled (as
        :meth:`settle_failed_attempts`), listed in ``PutResult.settled``.
        """
        entry = coerce_entry(entry)
        prep: ingest.Prepared | None = None
        if entry.prompt_is_delta:  # a NeMo Gym delta record: prove lineage on its full prompt
            n_tokens = entry.cum_len or 0
            if n_tokens > _OFFLOAD_DELTA_TOKENS:
                prep = await asyncio.to_thread(ingest.prepare_delta, entry, self._tips)
            else:
                prep = ingest.prepare_delta(entry, self._tips)
            if prep is None:  # the parent's tip is not remembered: rebuild from the store
                entry = await materialize_delta(entry, self._read_cumulative_bytes)
        if prep is None:
            n_tokens = len(entry.prompt_token_ids) + len(entry.generation_token_ids)
            if n_tokens > _OFFLOAD_TOKENS:
                prep = await asyncio.to_thread(ingest.prepare, entry, self._tips)
            else:
                prep = ingest.prepare(entry, self._tips)
        now = self._now()

        def steps(
            folded: bool, optimistic: bool = False, head: tuple[int, Any, int | None] | None = None
        ) -> ingest.Steps:
            return ingest.put_steps(
                prep,
                route=route,
                request_fingerprint=request_fingerprint,
                continuation_fingerprint=continuation_fingerprint,
                delta_records=self.delta_records,
                now=now,
                folded=folded,
                settle_key=settle_retry_key,
                optimistic=optimistic,
                head=head,
            )

        rid = entry.rollout_id
        tries: list[Callable[[], ingest.Steps]] = []
        if self.sql.optimistic_records:
            known = self._heads.get(rid)
            intent = self._heads.pop_intent(rid, entry.model_call_id)
            if known is not None:
                head = (*known, intent)
                tries.append(lambda: steps(True, optimistic=True, head=head))
            tries.append(lambda: steps(True, optimistic=True))

        out: ingest.Outcome = await self._run_steps(steps, optimistic=tries)
        if out.head is not None:
            self._heads.note(rid, *out.head)
        elif tries:  # written under the lock: the rollout's head is not known
            self._heads.forget(rid)
        if out.deferred is not None:
            raise out.deferred
        if out.status == "created" and out.pk is not None and prep.generation:
            self._tips.remember(entry.rollout_id, prep.tip(out.pk))
        parent = out.parent
        return PutResult(
            out.status,
            out.version,
            parent.model_call_id if parent else None,
            out.prompt_is_delta,
            parent.method if parent else None,
            out.settled,
        )

    async def mark_incomplete(
        self, rollout_id: str, model_call_id: str = "", *, reason: str, detail: str = ""
    ) -> int:
        """Durably mark the rollout incomplete (allowed after freeze; bumps the version)."""
        validate_rollout_id(rollout_id)
        # More available than ``put`` (NeMo Gym's TokenSink contract): the call id is whatever
        # the writer used, including one ``put`` refused, so it is stored, never validated.
        call_id, detail = _storable_call_id(model_call_id, detail)
        _validate_reason(reason)

        def body(conn: Connection) -> int:
            state = self._lock_rollout(conn, rollout_id)
            if state.state == "retired":
                raise RolloutRetired(
                    f"token capture for rollout {rollout_id} is retired; mark_incomplete refused",
                    rollout_id=rollout_id,
                )
            return self._add_incomplete(conn, rollout_id, call_id, reason, detail)

        return await self._transact(body)
