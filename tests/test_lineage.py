"""Lineage proven at ingest and delta records (issue #2 points 6 and 7), on both backends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine

from ledger import codec
from ledger.storage import ingest
from ledger.store import Ledger
from tests.test_promises import rec

Rid = Callable[[str], str]
SYS = list(range(100, 140))


@contextmanager
def capture_sql(led: Ledger) -> Iterator[list[str]]:
    seen: list[str] = []

    def before(_conn: Any, _cur: Any, statement: str, *_a: Any) -> None:
        seen.append(" ".join(statement.split()))

    def plain(statement: str) -> None:
        seen.append(" ".join(statement.split()))

    # Every engine (the ledger's async engine and the SQLite group-commit writer's own), and
    # the ingest hot path's plain SQL.
    event.listen(Engine, "before_cursor_execute", before)
    ingest.OBSERVERS.append(plain)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", before)
        ingest.OBSERVERS.remove(plain)


async def stored_prompt(led: Ledger, rollout_id: str, call_id: str) -> tuple[list[int], bool]:
    async with led.engine.connect() as conn:
        row = (
            await conn.execute(
                sa.text(
                    "SELECT t.prompt_ids, c.prompt_is_delta, t.ids_codec FROM call_tokens t "
                    "JOIN calls c ON c.id = t.call_id "
                    "WHERE c.rollout_id = :r AND c.model_call_id = :c"
                ),
                {"r": rollout_id, "c": call_id},
            )
        ).one()
    return codec.unpack_ids(codec.load_ids(row[2], row[0])), bool(row[1])


async def test_parent_is_the_longest_cumulative_prefix(ledger: Ledger, rid: Rid) -> None:
    r = rid("lin")
    await ledger.put(rec(r, "a", SYS, [1, 2]))
    await ledger.put(rec(r, "b", [*SYS, 1, 2, 7], [3]))
    res = await ledger.put(rec(r, "c", [*SYS, 1, 2, 7, 3, 8, 9], [4, 5]))
    assert res.parent_call_id == "b" and res.edge_method == "token_prefix"
    views = {v.model_call_id: v for v in (await ledger.freeze_views(r)).calls}
    assert views["a"].parent_call_id is None
    assert views["b"].parent_call_id == "a" and views["b"].edge_status == "verified"
    assert views["c"].parent_call_id == "b" and views["c"].shared_len == len(SYS) + 4


async def test_identical_parents_collapse_to_the_smallest_call_id(ledger: Ledger, rid: Rid) -> None:
    r = rid("ident")
    await ledger.put(rec(r, "zz-retry", SYS, [1, 2]))
    await ledger.put(rec(r, "aa-first", SYS, [1, 2], created_at=1.0))
    res = await ledger.put(rec(r, "child", [*SYS, 1, 2, 9], [3]))
    assert res.parent_call_id == "aa-first" and res.edge_method == "identical_retry"


async def test_no_proven_parent_is_a_root(ledger: Ledger, rid: Rid) -> None:
    r = rid("root")
    await ledger.put(rec(r, "a", SYS, [1, 2]))
    # Shares the system prompt but not a's generation: no captured call prefixes it.
    res = await ledger.put(rec(r, "title", [*SYS, 9, 9], [5]))
    assert res.parent_call_id is None and not res.prompt_is_delta


async def test_empty_generation_is_never_a_parent(ledger: Ledger, rid: Rid) -> None:
    r = rid("empty")
    await ledger.put(rec(r, "empty", SYS, []))
    res = await ledger.put(rec(r, "retry", SYS, [1, 2]))
    assert res.parent_call_id is None


async def test_candidates_are_found_without_loading_token_arrays(ledger: Ledger, rid: Rid) -> None:
    r = rid("sql")
    prompt = list(SYS)
    for i in range(6):
        await ledger.put(rec(r, f"c{i}", prompt, [1000 + i]))
        prompt = [*prompt, 1000 + i, 7]
    with capture_sql(ledger) as seen:
        res = await ledger.put(rec(r, "last", prompt, [1]))
    assert res.parent_call_id == "c5"
    assert any(s.startswith("SELECT") and "cumulative_digest" in s for s in seen), seen
    token_reads = [s for s in seen if "call_tokens" in s and s.startswith("SELECT")]
    # This ledger wrote c5's tokens and still holds their digest state: no token read at all.
    assert token_reads == []
    # A ledger that did not (another process, after a restart) reads exactly one token array:
    # the winner's generation, by its primary key.
    other = Ledger(ledger.url)
    try:
        with capture_sql(other) as seen:
            res = await other.put(rec(r, "last2", [*prompt, 1, 7], [2]))
    finally:
        await other.close()
    assert res.parent_call_id == "last"
    token_reads = [s for s in seen if "call_tokens" in s and s.startswith("SELECT")]
    assert len(token_reads) == 1, token_reads
    assert "generation_ids" in token_reads[0] and "prompt_ids" not in token_reads[0]


async def test_resolve_returns_parent_and_exact_cumulative_tokens(ledger: Ledger, rid: Rid) -> None:
    r = rid("resolve")
    await ledger.put(rec(r, "a", SYS, [1, 2]))
    await ledger.put(rec(r, "b", [*SYS, 1, 2, 7], [3, 4]))
    res = await ledger.resolve(r, [*SYS, 1, 2, 7, 3, 4, 8])
    assert res.status == "resolved" and res.model_call_id == "b"
    assert res.cumulative_token_ids == [*SYS, 1, 2, 7, 3, 4]
    assert res.digest == codec.token_digest([*SYS, 1, 2, 7, 3, 4])
    root = await ledger.resolve(r, [5, 5, 5])
    assert root.status == "root" and root.model_call_id is None
    assert (await ledger.resolve(rid("never"), SYS)).status == "root"


async def test_resolve_sees_writes_of_another_client(ledger: Ledger, db_url: str, rid: Rid) -> None:
    r = rid("visible")
    other = Ledger(db_url)
    try:
        assert (await other.resolve(r, [*SYS, 1, 2, 9])).status == "root"
        await ledger.put(rec(r, "a", SYS, [1, 2]))
        assert (await other.resolve(r, [*SYS, 1, 2, 9])).model_call_id == "a"
    finally:
        await other.close()


async def test_resolve_after_retire_is_unresolved(ledger: Ledger, rid: Rid) -> None:
    r = rid("retired")
    await ledger.put(rec(r, "a", SYS, [1, 2]))
    snap = await ledger.freeze(r)
    assert await ledger.retire(r, snapshot_id=snap.snapshot_id, version=snap.version)
    res = await ledger.resolve(r, [*SYS, 1, 2, 3])
    assert res.status == "unresolved" and res.reason == "rollout_retired"


async def test_delta_records_store_only_the_suffix(ledger: Ledger, rid: Rid) -> None:
    r = rid("delta")
    await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    await ledger.put(rec(r, "c2", [1, 2, 3, 4, 5, 6, 7], [8]))
    await ledger.put(rec(r, "c3", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11]))
    assert await stored_prompt(ledger, r, "c1") == ([1, 2, 3], False)
    assert await stored_prompt(ledger, r, "c2") == ([6, 7], True)
    assert await stored_prompt(ledger, r, "c3") == ([9], True)
    snap = await ledger.freeze(r)
    assert [e.prompt_token_ids for e in snap.entries] == [
        [1, 2, 3],
        [1, 2, 3, 4, 5, 6, 7],
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
    ]
    assert [e.generation_token_ids for e in snap.entries] == [[4, 5], [8], [10, 11]]
    assert not snap.incomplete
    chain = await ledger.load_chain(r, "c3")
    assert [link.prompt_suffix for link in chain] == [[1, 2, 3], [6, 7], [9]]


async def test_delta_records_can_be_switched_off(db_url: str, rid: Rid) -> None:
    led = Ledger(db_url, delta_records=False)
    try:
        r = rid("full")
        await led.put(rec(r, "c1", [1, 2, 3], [4, 5]))
        res = await led.put(rec(r, "c2", [1, 2, 3, 4, 5, 6], [7]))
        assert res.parent_call_id == "c1" and not res.prompt_is_delta
        assert await stored_prompt(led, r, "c2") == ([1, 2, 3, 4, 5, 6], False)
        chain = await led.load_chain(r, "c2")
        assert [link.prompt_suffix for link in chain] == [[1, 2, 3], [6]]
    finally:
        await led.close()


@pytest.mark.parametrize("damage", ["corrupt_parent_tokens", "break_digest"])
async def test_unreconstructable_chain_makes_rollout_incomplete(
    ledger: Ledger, rid: Rid, damage: str
) -> None:
    r = rid("broken")
    await ledger.put(rec(r, "c1", [1, 2, 3], [4, 5]))
    await ledger.put(rec(r, "c2", [1, 2, 3, 4, 5, 6], [7]))
    async with ledger.engine.begin() as conn:
        if damage == "corrupt_parent_tokens":
            await conn.execute(
                sa.text(
                    "UPDATE call_tokens SET generation_ids = :g WHERE call_id = "
                    "(SELECT id FROM calls WHERE rollout_id = :r AND model_call_id = 'c1')"
                ),
                {"g": codec.pack_ids([4, 9]), "r": r},
            )
        else:
            await conn.execute(
                sa.text(
                    "UPDATE calls SET cumulative_digest = :d "
                    "WHERE rollout_id = :r AND model_call_id = 'c2'"
                ),
                {"d": "0" * 64, "r": r},
            )
    snap = await ledger.freeze(r)
    assert snap.incomplete
    views = await ledger.freeze_views(r)
    assert "delta_chain_unreconstructable" in views.incomplete_reasons
    with pytest.raises(ValueError, match=r"digest|extend"):
        await ledger.load_chain(r, "c2")


async def test_drifted_edge_records_first_mismatch(ledger: Ledger, rid: Rid) -> None:
    r = rid("drift")
    await ledger.put(
        rec(r, "c1", [1, 2, 3], [4, 5, 6]),
        continuation_fingerprint="fp-after-c1",
    )
    # The harness re-rendered c1's turn: the conversation continues c1, the tokens do not.
    res = await ledger.put(
        rec(r, "c2", [1, 2, 3, 4, 9, 6, 7], [8]),
        request_fingerprint="fp-after-c1",
        continuation_fingerprint="fp-after-c2",
    )
    assert res.parent_call_id is None
    views = {v.model_call_id: v for v in (await ledger.freeze_views(r)).calls}
    assert views["c2"].parent_call_id == "c1" and views["c2"].edge_status == "drifted"
    assert views["c2"].edge_method == "conversation" and views["c2"].shared_len == 4
