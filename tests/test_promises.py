"""design.md §4 promises 1-6 and 10, and issue #2 point 5, on SQLite and Postgres."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from ledger.errors import (
    InvalidInput,
    InvalidRecord,
    InvalidRolloutId,
    LedgerError,
    PayloadConflict,
    RolloutFrozen,
    RolloutRetired,
    StateConflict,
    UnsupportedSchemaVersion,
)
from ledger.store import Ledger

Rid = Callable[[str], str]


def rec(
    rollout_id: str, call_id: str, prompt: list[int], gen: list[int], **over: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-0.25 * (i + 1) for i in range(len(gen))],
        "created_at": 1700000000.0,
        "output_items": [{"type": "message", "role": "assistant", "content": []}],
        "token_item_index": 0,
    }
    out.update(over)
    return out


async def table_counts(led: Ledger, rollout_id: str) -> dict[str, int]:
    out = {}
    async with led.engine.connect() as conn:
        for table in ("calls", "lineage_edges", "incomplete_events"):
            q = sa.text(f"SELECT count(*) FROM {table} WHERE rollout_id = :r")
            out[table] = (await conn.execute(q, {"r": rollout_id})).scalar_one()
        q = sa.text(
            "SELECT count(*) FROM call_tokens t JOIN calls c ON c.id = t.call_id "
            "WHERE c.rollout_id = :r"
        )
        out["call_tokens"] = (await conn.execute(q, {"r": rollout_id})).scalar_one()
    return out


async def test_promise_1_durable_ack_visible_to_a_fresh_client(
    ledger: Ledger, db_url: str, rid: Rid
) -> None:
    r = rid("ack")
    await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    other = Ledger(db_url)
    try:
        snap = await other.freeze(r)
    finally:
        await other.close()
    assert [e.model_call_id for e in snap.entries] == ["c1"]
    assert snap.entries[0].generation_token_ids == [4, 5]


async def test_promise_2_identical_repeat_is_a_noop(ledger: Ledger, rid: Rid) -> None:
    r = rid("idem")
    first = await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    again = await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    assert first.status == "created" and again.status == "duplicate"
    assert again.version == first.version
    assert (await ledger.get_state(r)).version == first.version
    assert (await table_counts(ledger, r))["call_tokens"] == 1


async def test_promise_2_conflicting_payload_refused_first_kept(ledger: Ledger, rid: Rid) -> None:
    r = rid("conflict")
    first = await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    with pytest.raises(PayloadConflict, match="different payload"):
        await ledger.put(rec(r, "c1", [1, 2, 3], [4, 6]))
    state = await ledger.get_state(r)
    assert state.incomplete and state.version == first.version + 1
    snap = await ledger.freeze(r)
    assert snap.incomplete
    assert [e.generation_token_ids for e in snap.entries] == [[4, 5]]


async def test_promise_3_no_new_record_after_freeze(ledger: Ledger, rid: Rid) -> None:
    r = rid("frozen")
    await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    snap = await ledger.freeze(r)
    with pytest.raises(RolloutFrozen, match="already frozen"):
        await ledger.put(rec(r, "c2", [1, 2, 3, 4, 5, 6], [7]))
    with pytest.raises(RolloutFrozen):
        await ledger.begin_call(r, "c3")
    # A byte-identical repeat of a record already in the snapshot changes nothing and is acked.
    assert (await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))).status == "duplicate"
    again = await ledger.freeze(r)
    assert (again.snapshot_id, again.version) == (snap.snapshot_id, snap.version)
    assert [e.model_call_id for e in again.entries] == ["c1"]


async def test_promise_4_atomic_snapshot_and_idempotent_freeze(ledger: Ledger, rid: Rid) -> None:
    r = rid("snap")
    await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    await ledger.put(rec(r, "c2", [1, 2, 3, 4, 5, 6], [7, 8]))
    open_version = (await ledger.get_state(r)).version
    a = await ledger.freeze(r)
    b = await ledger.freeze(r)
    assert a.snapshot_id and a.snapshot_id == b.snapshot_id
    assert a.version == b.version == open_version + 1
    assert [e.model_dump_json() for e in a.entries] == [e.model_dump_json() for e in b.entries]
    assert not a.incomplete
    await ledger.mark_incomplete(r, "c9", reason="capture_failed")
    c = await ledger.freeze(r)
    assert c.snapshot_id == a.snapshot_id and c.version == a.version + 1 and c.incomplete


async def test_promise_4_freezing_an_unknown_rollout_leaves_it_frozen_empty(
    ledger: Ledger, rid: Rid
) -> None:
    r = rid("unknown")
    snap = await ledger.freeze(r)
    assert snap.entries == () and not snap.incomplete and snap.snapshot_id
    with pytest.raises(RolloutFrozen):
        await ledger.put(rec(r, "c1", [1], [2]))


async def test_promise_5_conditional_retire_keeps_tombstone(ledger: Ledger, rid: Rid) -> None:
    r = rid("retire")
    await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    snap = await ledger.freeze(r)
    assert not await ledger.retire(r, snapshot_id=snap.snapshot_id, version=snap.version + 1)
    assert not await ledger.retire(r, snapshot_id="0" * 32, version=snap.version)
    assert (await table_counts(ledger, r))["call_tokens"] == 1
    assert await ledger.retire(r, snapshot_id=snap.snapshot_id, version=snap.version)
    # A repeat at exactly that identity (a retry after a lost answer) answers True, as over HTTP;
    # any other identity after retire retires nothing.
    assert await ledger.retire(r, snapshot_id=snap.snapshot_id, version=snap.version)
    assert not await ledger.retire(r, snapshot_id=snap.snapshot_id, version=snap.version + 1)
    assert (await table_counts(ledger, r))["call_tokens"] == 0
    state = await ledger.get_state(r)
    assert state.state == "retired"
    for late in (
        ledger.put(rec(r, "c2", [9], [9])),
        ledger.begin_call(r, "c3"),
        ledger.freeze(r),
        ledger.mark_incomplete(r, reason="capture_failed"),
    ):
        with pytest.raises(RolloutRetired, match="retired"):
            await late


async def test_promise_5_any_later_change_makes_retire_fail(ledger: Ledger, rid: Rid) -> None:
    r = rid("stale")
    await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    snap = await ledger.freeze(r)
    await ledger.mark_incomplete(r, reason="upstream_error", detail="late failure")
    assert not await ledger.retire(r, snapshot_id=snap.snapshot_id, version=snap.version)
    # A re-created rollout (admin delete, then new writes) has a new identity too.
    await ledger.delete_rollout(r)
    await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    fresh = await ledger.freeze(r)
    assert fresh.snapshot_id != snap.snapshot_id
    assert not await ledger.retire(r, snapshot_id=snap.snapshot_id, version=snap.version)


async def test_sweep_removes_only_old_tombstones(ledger: Ledger, rid: Rid) -> None:
    old, live = rid("old"), rid("live")
    for r in (old, live):
        await ledger.put(rec(r, "c1", [1], [2]))
    snap = await ledger.freeze(old)
    assert await ledger.retire(old, snapshot_id=snap.snapshot_id, version=snap.version)
    assert await ledger.sweep(timedelta(hours=1)) == 0
    assert (await ledger.get_state(old)).state == "retired"
    removed = await ledger.sweep(timedelta(seconds=-1))
    assert removed >= 1
    with pytest.raises(LedgerError, match="no rollout"):
        await ledger.get_state(old)
    assert (await ledger.get_state(live)).state == "open"


async def test_promise_6_dangling_intent_makes_freeze_incomplete(ledger: Ledger, rid: Rid) -> None:
    r = rid("dangling")
    await ledger.begin_call(r, "c1")
    await ledger.put(rec(r, "c1", [1, 2], [3]))
    await ledger.begin_call(r, "c2")  # dispatched, never recorded
    v_before = (await ledger.get_state(r)).version
    snap = await ledger.freeze(r)
    assert snap.incomplete and snap.version == v_before + 1
    views = await ledger.freeze_views(r)
    assert "dangling_intent" in views.incomplete_reasons


async def test_cancelled_intent_does_not_dangle(ledger: Ledger, rid: Rid) -> None:
    r = rid("cancel")
    await ledger.begin_call(r, "c1")
    v = (await ledger.get_state(r)).version
    assert await ledger.cancel_call(r, "c1")
    assert not await ledger.cancel_call(r, "c1")
    assert (await ledger.get_state(r)).version == v
    snap = await ledger.freeze(r)
    assert not snap.incomplete and snap.entries == ()


async def test_mark_incomplete_after_freeze_bumps_version(ledger: Ledger, rid: Rid) -> None:
    r = rid("mark")
    await ledger.put(rec(r, "c1", [1, 2], [3]))
    snap = await ledger.freeze(r)
    v = await ledger.mark_incomplete(r, "c2", reason="missing_token_ids", detail="no ids")
    assert v == snap.version + 1
    views = await ledger.freeze_views(r)
    assert views.incomplete and "missing_token_ids" in views.incomplete_reasons


async def test_admin_delete_allows_a_fresh_start(ledger: Ledger, rid: Rid) -> None:
    r = rid("delete")
    await ledger.put(rec(r, "c1", [1, 2], [3]))
    await ledger.freeze(r)
    assert await ledger.delete_rollout(r)
    assert not await ledger.delete_rollout(r)
    assert await table_counts(ledger, r) == {
        "calls": 0,
        "lineage_edges": 0,
        "incomplete_events": 0,
        "call_tokens": 0,
    }
    assert (await ledger.put(rec(r, "c1", [1, 2], [3]))).status == "created"


@pytest.mark.parametrize(
    ("bad", "error", "needle"),
    [
        ({"rollout_id": "has space"}, InvalidRecord, "rollout id"),
        ({"model_call_id": "../etc"}, InvalidRecord, "model_call_id"),
        ({"generation_log_probs": [-1.0]}, InvalidRecord, "same length"),
        ({"prompt_token_ids": [1, 2**33]}, InvalidRecord, "int32"),
        ({"schema_version": 9}, UnsupportedSchemaVersion, "upgrade"),
        ({"prompt_token_ids": "1,2,3"}, InvalidRecord, "prompt_token_ids"),
    ],
)
async def test_promise_10_bad_input_changes_nothing(
    ledger: Ledger, rid: Rid, bad: dict[str, Any], error: type[Exception], needle: str
) -> None:
    r = rid("bad")
    await ledger.put(rec(r, "c1", [1, 2], [3]))
    before = (await ledger.get_state(r), await table_counts(ledger, r))
    body = rec(r, "c2", [1, 2, 3, 4], [5, 6])
    body.update(bad)
    with pytest.raises(error, match=needle):
        await ledger.put(body)
    assert (await ledger.get_state(r), await table_counts(ledger, r)) == before


async def test_promise_10_bad_reason_and_ids_refused(ledger: Ledger, rid: Rid) -> None:
    r = rid("badreason")
    with pytest.raises(InvalidInput, match="snake_case"):
        await ledger.mark_incomplete(r, reason="Not A Reason!")
    with pytest.raises(InvalidRolloutId):
        await ledger.freeze("")
    with pytest.raises(InvalidRolloutId):
        await ledger.begin_call(r, "bad id")


def test_error_tree_is_documented_and_typed() -> None:
    import ledger.errors as errors

    assert issubclass(PayloadConflict, StateConflict)
    assert issubclass(RolloutFrozen, StateConflict) and issubclass(RolloutRetired, StateConflict)
    assert issubclass(InvalidInput, ValueError)
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, LedgerError)
        assert name in (errors.__doc__ or "") or name == "LedgerError"
