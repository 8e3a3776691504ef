"""A successful identical retry cancels the failed attempts noted for it (issue 11), in the
record's own transaction (issue 12): whichever process noted them, on both backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from ledger.storage import queries
from ledger.store import Ledger
from tests.test_lineage import capture_sql
from tests.test_promises import rec

Rid = Callable[[str], str]
KEY = "a" * 64


async def statuses(led: Ledger, rollout_id: str) -> dict[str, str]:
    c = queries.calls
    async with led.engine.connect() as conn:
        rows = await conn.execute(
            sa.select(c.c.model_call_id, c.c.status).where(c.c.rollout_id == rollout_id)
        )
        return {r.model_call_id: r.status for r in rows}


async def set_extra(led: Ledger, rollout_id: str, call_id: str, extra: Any) -> None:
    c = queries.calls
    async with led.engine.begin() as conn:
        await conn.execute(
            c.update()
            .where(c.c.rollout_id == rollout_id, c.c.model_call_id == call_id)
            .values(extra=extra)
        )


async def failed(led: Ledger, rollout_id: str, call_id: str, key: str) -> None:
    await led.begin_call(rollout_id, call_id)
    noted = await led.note_failed_attempt(
        rollout_id, call_id, reason="upstream_error", detail="503", retry_key=key
    )
    assert noted


async def test_the_record_cancels_attempts_another_process_noted(
    ledger: Ledger, db_url: str, rid: Rid
) -> None:
    r = rid("settle")
    other = Ledger(db_url)  # another worker sharing the database
    try:
        await failed(other, r, "a1", KEY)
        await failed(other, r, "a2", KEY)
        await failed(other, r, "b1", "b" * 64)  # another request's failure
        await other.begin_call(r, "open")  # in flight, nothing failed
    finally:
        await other.close()
    await ledger.begin_call(r, "ok")
    res = await ledger.put(rec(r, "ok", [1, 2, 3], [4, 5]), settle_retry_key=KEY)
    assert res.status == "created"
    assert sorted(res.settled or ()) == ["a1", "a2"]
    assert await statuses(ledger, r) == {
        "a1": "cancelled",
        "a2": "cancelled",
        "b1": "intent",
        "open": "intent",
        "ok": "captured",
    }
    # Nothing is left for the same key; a put without a key looks for nothing.
    again = await ledger.put(rec(r, "ok2", [1, 2, 3], [6]), settle_retry_key=KEY)
    assert again.settled == ()
    plain = await ledger.put(rec(r, "ok3", [1, 2, 3], [7]))
    assert plain.settled is None
    assert (await statuses(ledger, r))["b1"] == "intent"


async def test_an_identical_repeat_settles_only_while_open(ledger: Ledger, rid: Rid) -> None:
    r = rid("settledup")
    first = await ledger.put(rec(r, "ok", [1, 2], [3]))
    assert first.status == "created"
    await failed(ledger, r, "a1", KEY)
    dup = await ledger.put(rec(r, "ok", [1, 2], [3]), settle_retry_key=KEY)
    assert (dup.status, dup.settled) == ("duplicate", ("a1",))
    await failed(ledger, r, "a2", KEY)
    await ledger.freeze(r)
    late = await ledger.put(rec(r, "ok", [1, 2], [3]), settle_retry_key=KEY)
    assert (late.status, late.settled) == ("duplicate", None)
    assert (await statuses(ledger, r))["a2"] == "intent"  # freeze already judged it
    assert await ledger.settle_failed_attempts(r, KEY) == []


async def test_settling_on_its_own(ledger: Ledger, rid: Rid) -> None:
    r = rid("settlealone")
    assert await ledger.settle_failed_attempts(r, KEY) == []  # no rollout: nothing to do
    await failed(ledger, r, "a1", KEY)
    await failed(ledger, r, "b1", "b" * 64)
    assert await ledger.settle_failed_attempts(r, KEY) == ["a1"]
    assert await ledger.settle_failed_attempts(r, KEY) == []
    assert await statuses(ledger, r) == {"a1": "cancelled", "b1": "intent"}


async def test_notes_of_another_shape_are_left_alone(ledger: Ledger, rid: Rid) -> None:
    """Only a string retry key under ``failed_attempt`` matches; any other JSON in an open
    intent's ``extra`` neither matches nor breaks the record."""
    r = rid("settleodd")
    odd: dict[str, Any] = {
        "num": {"failed_attempt": {"retry_key": 123}},
        "flat": {"failed_attempt": "123"},
        "list": {"failed_attempt": ["123"]},
        "other": {"note": {"retry_key": "123"}},
        "scalar": "123",
    }
    for call_id, extra in odd.items():
        await ledger.begin_call(r, call_id)
        await set_extra(ledger, r, call_id, extra)
    res = await ledger.put(rec(r, "ok", [1], [2]), settle_retry_key="123")
    assert (res.status, res.settled) == ("created", ())
    assert set((await statuses(ledger, r)).values()) == {"intent", "captured"}


async def test_settling_is_one_statement_of_the_record(ledger: Ledger, rid: Rid) -> None:
    """The common case (nothing failed) costs the record one update on its own driver: no
    read or transaction of its own."""
    r = rid("settlesql")
    await ledger.begin_call(r, "ok")
    with capture_sql(ledger) as seen:
        res = await ledger.put(rec(r, "ok", [1, 2, 3], [4]), settle_retry_key=KEY)
    assert (res.status, res.settled) == ("created", ())
    # SQLite: its own statement in the writer's transaction; Postgres: part of the record's
    # one statement.
    settles = [s for s in seen if "SET status = 'cancelled'" in s]
    assert len(settles) == 1
    assert not [s for s in seen if "failed_attempt" in s and s not in settles]


async def test_a_record_over_its_own_noted_intent_is_stored(ledger: Ledger, rid: Rid) -> None:
    """The record's own intent is never cancelled by its settling, even when it carries a
    note with the same key."""
    r = rid("settleself")
    await failed(ledger, r, "a1", KEY)
    res = await ledger.put(rec(r, "a1", [1, 2], [3]), settle_retry_key=KEY)
    assert (res.status, res.settled) == ("created", ())
    assert await statuses(ledger, r) == {"a1": "captured"}
