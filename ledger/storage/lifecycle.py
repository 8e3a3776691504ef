"""After the build: retire (the conditional-retire rule), delete, sweep, state, deliveries."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.engine import Connection

from ledger.errors import (
    NotFound,
)
from ledger.ids import validate_rollout_id
from ledger.model import Quarantine
from ledger.storage import ingest, queries
from ledger.storage.core import LedgerCore, _state_of
from ledger.storage.results import RetireOutcome, RolloutState
from ledger.tables import (
    utcnow,
)


class LifecycleOps(LedgerCore):
    """Retire, admin and delivery rows (a mixin of ``Ledger``)."""

    async def retire(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire exactly the consumed snapshot (§4.5): delete token payloads, keep a tombstone.

        True when the snapshot is retired at that identity, by this call or by an earlier one (a
        repeat after a lost answer); False, changing nothing, when the rollout is not frozen at
        that identity, was retired at another one, or is unknown.  The same answer as over HTTP.
        """
        return (
            await self.retire_outcome(rollout_id, snapshot_id=snapshot_id, version=version)
        ).retired

    async def retire_outcome(
        self, rollout_id: str, *, snapshot_id: str, version: int
    ) -> RetireOutcome:
        """``retire`` with the rule's full answer (see :class:`RetireOutcome`): the conditional
        update and, when it retires nothing, the read that says why, in one transaction."""
        validate_rollout_id(rollout_id)

        def body(conn: Connection) -> RetireOutcome:
            now = utcnow()
            hit = conn.execute(
                queries.retire_consumed(rollout_id, snapshot_id, version, now)
            ).one_or_none()
            if hit is None:
                return self._why_not_retired(conn, rollout_id, snapshot_id, version)
            conn.execute(queries.delete_rollout_tokens(rollout_id))
            conn.execute(queries.retire_deliveries(rollout_id, snapshot_id, version, now))
            state = RolloutState(rollout_id, "retired", hit.incomplete, snapshot_id, version)
            return RetireOutcome("retired", state)

        outcome = await self._transact(body)
        if outcome.status == "retired":
            self._tips.forget(rollout_id)
            self._heads.forget(rollout_id)
        return outcome

    async def delete_rollout(self, rollout_id: str) -> bool:
        """Admin: remove every trace of a rollout (before re-dispatching its id)."""
        validate_rollout_id(rollout_id)

        def body(conn: Connection) -> bool:
            res = conn.execute(queries.delete_rollout(rollout_id))
            return bool(res.rowcount)

        self._tips.forget(rollout_id)
        self._heads.forget(rollout_id)
        return await self._transact(body)

    async def sweep(self, older_than: timedelta) -> int:
        """Remove retired tombstones retired at or before ``now - older_than``."""
        cutoff = datetime.now(UTC) - older_than

        def body(conn: Connection) -> int:
            res = conn.execute(queries.delete_retired_tombstones(cutoff))
            return int(res.rowcount or 0)

        return await self._transact(body)

    async def get_state(self, rollout_id: str) -> RolloutState:
        validate_rollout_id(rollout_id)
        async with self._read() as conn:
            row = (await conn.execute(queries.rollout_head(rollout_id))).one_or_none()
        if row is None:
            raise NotFound(f"no rollout {rollout_id!r} in the ledger", rollout_id=rollout_id)
        return _state_of(rollout_id, row)

    # ----------------------------------------------------------------- deliveries

    async def record_delivery(
        self,
        rollout_id: str,
        *,
        snapshot_id: str | None,
        version: int | None,
        outcome: str,
        mask_reasons: Sequence[str],
        metrics: dict[str, Any],
        terminal: dict[str, Any] | None,
        quarantines: Iterable[Quarantine] = (),
        consumer: str = "",
        idempotency_key: str | None = None,
        handed_off: bool = False,
    ) -> int:
        """Store one build of a snapshot with its outcome, reasons, metrics and quarantines.

        ``handed_off``: the build is handed to its consumer now; the row carries that mark from
        its own transaction, so no delivery row is ever seen built but not handed off.
        """
        handed_off_at = utcnow() if handed_off else None
        quarantined = tuple(quarantines)
        if self.sql.lone_statements_in_autocommit and idempotency_key is None and not quarantined:
            # The usual build: its row in one statement, in autocommit (one round trip).
            values = (
                rollout_id,
                rollout_id,
                snapshot_id,
                version,
                outcome,
                json.dumps(list(mask_reasons)),
                json.dumps(metrics),
                # None as JSON null, as the general form's JSON column stores it (not SQL NULL).
                json.dumps(terminal),
                consumer,
                utcnow(),
                handed_off_at,
            )
            did = await self._run_steps(lambda _folded: ingest.delivery_steps(values), single=True)
            if did is not None:
                return int(did)

        def body(conn: Connection) -> int:
            self._lock_rollout(conn, rollout_id)
            if idempotency_key is not None:
                prior = conn.execute(queries.delivery_by_key(idempotency_key)).scalar_one_or_none()
                if prior is not None:
                    if handed_off_at is not None:
                        conn.execute(queries.stamp_delivery(prior, handed_off_at=handed_off_at))
                    return int(prior)
            did = conn.execute(
                queries.insert_delivery(
                    rollout_id=rollout_id,
                    snapshot_id=snapshot_id,
                    version=version,
                    outcome=outcome,
                    mask_reasons=list(mask_reasons),
                    metrics=metrics,
                    terminal=terminal,
                    consumer=consumer,
                    idempotency_key=idempotency_key,
                    handed_off_at=handed_off_at,
                )
            ).scalar_one()
            rows = [
                {
                    "rollout_id": rollout_id,
                    "delivery_id": did,
                    "model_call_id": quarantine.model_call_id,
                    "reason": quarantine.reason,
                    "detail": quarantine.detail,
                }
                for quarantine in quarantined
            ]
            if rows:
                conn.execute(queries.insert_quarantines(), rows)
            return int(did)

        return await self._transact(body)

    async def mark_delivery(
        self, delivery_id: int, *, handed_off: bool = False, durable: bool = False
    ) -> None:
        """Stamp a delivery as handed off and/or durably acknowledged by the consumer."""
        values: dict[str, Any] = {}
        if handed_off:
            values["handed_off_at"] = utcnow()
        if durable:
            values["durable_ack_at"] = utcnow()
        if not values:
            return

        def body(conn: Connection) -> None:
            res = conn.execute(queries.stamp_delivery(delivery_id, **values))
            if not res.rowcount:
                raise NotFound(f"no delivery {delivery_id} in the ledger")

        return await self._transact(body)

    def _why_not_retired(
        self, conn: Connection, rollout_id: str, snapshot_id: str, version: int
    ) -> RetireOutcome:
        """The retire rule for a conditional update that matched nothing, read under the lock."""
        row = conn.execute(self.sql.for_update(queries.rollout_head(rollout_id))).one_or_none()
        if row is None:
            return RetireOutcome("unknown", None)
        state = _state_of(rollout_id, row)
        if state.state != "retired":
            return RetireOutcome("stale", state)
        if (state.snapshot_id, state.version) == (snapshot_id, version):
            return RetireOutcome("repeat", state)
        return RetireOutcome("retired_elsewhere", state)
