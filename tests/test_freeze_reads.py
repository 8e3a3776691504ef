"""The build's reads of a frozen snapshot, on both backends: what ``freeze_views`` and
``load_chain`` return (edges, distinct incomplete reasons, JSON columns decoded), and the
statements a warm build of an existing rollout issues."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ledger.delivery import finalize_rollout_token_capture
from ledger.store import Ledger
from tests.test_lineage import capture_sql
from tests.test_promises import rec

Rid = Callable[[str], str]
SYS = list(range(100, 140))
ITEMS = [
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "é ☃"}]},
    {"type": "message", "role": "assistant", "content": [], "n": 2**40, "f": 0.1},
]


async def _chain(ledger: Ledger, r: str) -> None:
    await ledger.put(rec(r, "a", SYS, [1, 2], output_items=ITEMS, token_item_index=1))
    await ledger.put(rec(r, "b", [*SYS, 1, 2, 7], [3], created_at=1700000001.0))
    await ledger.put(rec(r, "c", [*SYS, 1, 2, 7, 3, 8], [4, 5], created_at=1700000002.0))


async def test_views_carry_edges_distinct_reasons_and_decoded_items(
    ledger: Ledger, rid: Rid
) -> None:
    r = rid("views")
    await _chain(ledger, r)
    await ledger.mark_incomplete(r, "x1", reason="upstream_error", detail="one")
    await ledger.mark_incomplete(r, "x2", reason="upstream_error", detail="two")
    await ledger.mark_incomplete(r, "x3", reason="dangling_intent", detail="three")
    views = await ledger.freeze_views(r)
    assert views.incomplete and views.n_calls == 3
    assert views.incomplete_reasons == ("dangling_intent", "upstream_error")
    by_id = {v.model_call_id: v for v in views.calls}
    assert [v.model_call_id for v in views.calls] == ["a", "b", "c"]
    assert by_id["a"].parent_call_id is None and by_id["a"].output_items == ITEMS
    assert by_id["b"].parent_call_id == "a" and by_id["b"].edge_status == "verified"
    assert by_id["c"].parent_call_id == "b" and by_id["c"].shared_len == len(SYS) + 4
    links = await ledger.load_chain(r, "c", expect=["a", "b", "c"])
    assert links[0].output_items == ITEMS and links[0].token_item_index == 1
    assert [link.prompt_suffix for link in links] == [SYS, [7], [8]]
    assert links[0].routed_experts is None


async def test_views_of_a_rollout_without_edges_or_reasons(ledger: Ledger, rid: Rid) -> None:
    r = rid("bare")
    await ledger.put(rec(r, "only", SYS, [1]))
    views = await ledger.freeze_views(r)
    assert views.incomplete_reasons == () and not views.incomplete
    assert [(v.model_call_id, v.parent_call_id) for v in views.calls] == [("only", None)]
    empty = await ledger.freeze_views(rid("unknown"))  # an unknown rollout freezes empty
    assert empty.calls == () and empty.n_calls == 0


async def test_a_warm_build_locks_once_per_transaction_and_reads_edges_with_reasons(
    ledger: Ledger, rid: Rid
) -> None:
    r = rid("warm")
    await _chain(ledger, r)

    def result() -> dict[str, Any]:
        return {"_ng_rollout_id": r, "response": {"id": None, "output": []}}

    first = await finalize_rollout_token_capture(result(), ledger)
    assert first is not None and not first["mask_sample"]
    with capture_sql(ledger) as seen:
        again = await finalize_rollout_token_capture(result(), ledger)
    assert again is not None and again["outcome"] == first["outcome"] == "delivered"
    assert (again["snapshot_id"], again["version"]) == (first["snapshot_id"], first["version"])
    statements = [s for s in seen if not s.upper().startswith(("BEGIN", "COMMIT", "ROLLBACK"))]
    # The rollout exists: no create, one locking read in freeze and one in the delivery row.
    assert not [s for s in statements if s.startswith("INSERT INTO rollouts")]
    assert len([s for s in statements if "FROM rollouts" in s]) == 2
    # Edges and incomplete reasons in one statement; one chain read; one delivery row.
    assert len([s for s in statements if "lineage_edges" in s or "incomplete_events" in s]) == 1
    assert len([s for s in statements if s.startswith("WITH RECURSIVE")]) == 1
    assert len([s for s in statements if "INSERT INTO deliveries" in s]) == 1
    # Postgres takes the delivery row's lock in the insert itself (one statement, autocommit).
    assert len(statements) == (5 if ledger.sql.lone_statements_in_autocommit else 6), statements
