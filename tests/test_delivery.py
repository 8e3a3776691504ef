"""Rebuild, deliver and retire (issue #3 points 1-5 and 9), on SQLite and Postgres."""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

from ledger.delivery import finalize_rollout_token_capture, retire_rollout_token_capture
from ledger.errors import InvalidInput
from ledger.projection import assert_prefix_contiguous
from ledger.store import Audit, Ledger

Rid = Callable[[str], str]
SYS = list(range(1000, 1040))


class Scripted:
    """Writes calls the way the proxy would: each prompt extends what the harness saw."""

    def __init__(self, ledger: Ledger, rollout_id: str) -> None:
        self.ledger = ledger
        self.rollout_id = rollout_id
        self.t = 1700000000.0
        self.calls: dict[str, tuple[list[int], list[int], list[float]]] = {}

    async def call(
        self,
        call_id: str,
        prompt: list[int],
        gen: list[int],
        *,
        text: str = "",
        tool: str | None = None,
        response_id: str | None = None,
        items: list[dict[str, Any]] | None = None,
        intent: bool = True,
    ) -> list[int]:
        self.t += 1.0
        lps = [-0.125 * (1 + (i % 7)) for i in range(len(gen))]
        if items is None:
            items = [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text or f"answer {call_id}"}],
                }
            ]
            if tool:
                items.append(
                    {
                        "type": "function_call",
                        "call_id": f"t-{call_id}",
                        "name": tool,
                        "arguments": "{}",
                    }
                )
        if intent:
            await self.ledger.begin_call(self.rollout_id, call_id)
        await self.ledger.put(
            {
                "rollout_id": self.rollout_id,
                "model_call_id": call_id,
                "model": "smol",
                "prompt_token_ids": prompt,
                "generation_token_ids": gen,
                "generation_log_probs": lps,
                "output_items": items,
                "token_item_index": len(items) - 1 if items else None,
                "created_at": self.t,
                "response_id": response_id or f"chatcmpl-{call_id}",
            }
        )
        self.calls[call_id] = (prompt, gen, lps)
        return [*prompt, *gen]


def result_for(rollout_id: str, **over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "_ng_rollout_id": rollout_id,
        "reward": 1.0,
        "response": {
            "id": "resp-final",
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "done"}],
                }
            ],
        },
    }
    out.update(over)
    return out


def carriers(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in result["response"]["output"] if "generation_token_ids" in i]


def expected_sequence(s: Scripted, chain: list[str]) -> tuple[list[int], list[float]]:
    last_prompt, last_gen, _ = s.calls[chain[-1]]
    lps: list[float] = []
    for cid in chain:
        lps += s.calls[cid][2]
    return [*last_prompt, *last_gen], lps


async def tool_loop(s: Scripted, n: int, prefix: str = "c") -> list[int]:
    ctx = list(SYS)
    for i in range(n):
        gen = [2000 + 10 * i + k for k in range(3)]
        ctx = await s.call(f"{prefix}{i}", ctx, gen, tool="search" if i < n - 1 else None)
        ctx = [*ctx, 3000 + i, 3001 + i]  # the tool result / next user turn
    return ctx


async def test_multi_turn_tool_rollout_delivers_one_exact_chain(ledger: Ledger, rid: Rid) -> None:
    r = rid("tools")
    s = Scripted(ledger, r)
    await tool_loop(s, 4)
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and build["outcome"] == "delivered"
    assert "mask_sample" not in result
    m = result["_ng_token_capture"]
    assert (m["n_calls"], m["chains"], m["roots"], m["delivered_fraction"]) == (4, 1, 1, 1.0)
    assert m["quarantined_calls"] == 0 and m["unresolved_parent_calls"] == 0
    assert m["empty_generation_calls"] == 0 and m["capture_incomplete"] is False
    assert result["reward"] == 1.0 and result["response"]["id"] == "resp-final"
    assert_prefix_contiguous(result["response"])
    cs = carriers(result)
    assert len(cs) == 4
    seq, lps = expected_sequence(s, ["c0", "c1", "c2", "c3"])
    assert [*cs[-1]["prompt_token_ids"], *cs[-1]["generation_token_ids"]] == seq
    assert [lp for c in cs for lp in c["generation_log_probs"]] == lps
    # Text and tool calls are preserved around the carriers.
    kinds = [i["type"] for i in result["response"]["output"]]
    assert kinds.count("function_call") == 3
    assert result["response"]["usage"]["output_tokens"] == 12
    assert result["response"]["usage"]["input_tokens"] == len(SYS)
    assert await retire_rollout_token_capture(r, ledger, build)
    assert (await ledger.get_state(r)).state == "retired"


async def test_delivery_row_and_its_handed_off_mark_are_one_write(ledger: Ledger, rid: Rid) -> None:
    """Issue 9: the build's delivery row carries its handed-off mark from its own transaction
    (stamped no later than the row was built), never a second write after it; a refused row
    leaves neither."""
    r = rid("handoff")
    s = Scripted(ledger, r)
    await tool_loop(s, 1)
    build = await finalize_rollout_token_capture(result_for(r), ledger)
    assert build is not None
    (row,) = (await Audit(ledger).rollout_detail(r))["deliveries"]
    built, handed = (datetime.fromisoformat(row[k]) for k in ("built_at", "handed_off_at"))
    assert handed <= built
    kept = {"snapshot_id": None, "version": None, "mask_reasons": [], "metrics": {}}
    plain = await ledger.record_delivery(r, outcome="masked", terminal=None, **kept)
    with pytest.raises(InvalidInput):
        await ledger.record_delivery(r, outcome="nonsense", terminal=None, handed_off=True, **kept)
    rows = (await Audit(ledger).rollout_detail(r))["deliveries"]
    assert [(d["id"], d["handed_off_at"] is not None) for d in rows] == [
        (row["id"], True),
        (plain, False),
    ]


async def test_delivery_row_is_the_same_whichever_form_writes_it(ledger: Ledger, rid: Rid) -> None:
    """Postgres writes a usual build's delivery row in one statement (no idempotency key, no
    quarantines, the rollout's row already there); the general form writes every other row,
    and every row on SQLite.  The stored row is the same either way: JSON columns as objects
    (a JSON null terminal included), the handed-off mark, the rollout created when missing."""
    r = rid("forms")
    args: dict[str, Any] = {
        "snapshot_id": "snap-1",
        "version": 3,
        "outcome": "masked",
        "mask_reasons": ["capture_incomplete", "upstream_error"],
        "metrics": {"calls": 2, "nested": {"ids": [1, 2], "ok": True, "none": None}},
        "terminal": {"call": "c-1", "method": "token_prefix"},
        "consumer": "trainer-7",
        "handed_off": True,
    }
    created = await ledger.record_delivery(r, **args)  # no rollout row yet: the general form
    assert (await ledger.get_state(r)).state == "open"
    usual = await ledger.record_delivery(r, **args)
    keyed = await ledger.record_delivery(r, idempotency_key=f"{r}-key", **args)
    bare = await ledger.record_delivery(r, **{**args, "terminal": None, "handed_off": False})
    rows = {d["id"]: d for d in (await Audit(ledger).rollout_detail(r))["deliveries"]}
    assert list(rows) == [created, usual, keyed, bare]

    def content(row: dict[str, Any]) -> dict[str, Any]:
        stamps = ("id", "built_at", "handed_off_at", "idempotency_key")
        return {k: v for k, v in row.items() if k not in stamps}

    assert content(rows[usual]) == content(rows[created]) == content(rows[keyed])
    assert rows[usual]["metrics"] == args["metrics"]
    assert rows[usual]["mask_reasons"] == args["mask_reasons"]
    assert rows[usual]["terminal"] == args["terminal"]
    assert rows[usual]["rollout_id"] == r and rows[usual]["version"] == 3
    assert rows[usual]["handed_off_at"] is not None and rows[usual]["idempotency_key"] is None
    assert rows[bare]["terminal"] is None and rows[bare]["handed_off_at"] is None
    assert content(rows[bare]) == {**content(rows[usual]), "terminal": None}
    with pytest.raises(InvalidInput):  # the outcome's check, by the one-statement form too
        await ledger.record_delivery(r, **{**args, "outcome": "nonsense"})
    assert len((await Audit(ledger).rollout_detail(r))["deliveries"]) == 4


async def test_audit_reason_filter_matches_exact_reasons_of_the_latest_build(
    ledger: Ledger, rid: Rid
) -> None:
    """Issue 9: the listing's reason filter (in SQL) matches a mask reason or a cause behind
    ``capture_incomplete`` of each rollout's latest build, exactly (no substring), and pages."""
    p = rid("why")
    ids = [f"{p}-{n}" for n in "abcde"]
    builds: dict[str, list[tuple[list[str], list[str]]]] = {
        ids[0]: [(["capture_incomplete"], ["upstream_error"])],
        ids[1]: [(["upstream_error"], [])],
        ids[2]: [(["capture_incomplete"], ["upstream"])],  # a prefix of the reason: no match
        ids[3]: [(["upstream_error"], []), ([], [])],  # only an older build named it
        ids[4]: [(["capture_incomplete"], ["upstream_error", "dangling_intent"])],
    }
    for r, history in builds.items():
        for masks, causes in history:
            await ledger.record_delivery(
                r,
                snapshot_id=None,
                version=None,
                outcome="masked" if masks else "delivered",
                mask_reasons=masks,
                metrics={"incomplete_reasons": causes} if causes else {},
                terminal=None,
            )
    audit = Audit(ledger)

    async def listing(reason: str) -> list[str]:
        found: list[str] = []
        cursor: str | None = p
        while cursor is not None and cursor.startswith(p):
            page, cursor = await audit.list_rollouts(reason=reason, limit=1, cursor=cursor)
            assert len(page) <= 1
            found += [s.rollout_id for s in page if s.rollout_id.startswith(p)]
        return found

    assert await listing("upstream_error") == [ids[0], ids[1], ids[4]]
    assert await listing("upstream") == [ids[2]]
    assert await listing("dangling_intent") == [ids[4]]
    assert await listing("capture_incomplete") == [ids[0], ids[2], ids[4]]
    assert await listing("never_named") == []
    (row,), _ = await audit.list_rollouts(reason="dangling_intent", cursor=p, limit=1)
    assert row.incomplete_reasons == ("upstream_error", "dangling_intent")


async def test_build_is_recorded_in_deliveries(ledger: Ledger, rid: Rid) -> None:
    r = rid("recorded")
    s = Scripted(ledger, r)
    await tool_loop(s, 2)
    build = await finalize_rollout_token_capture(result_for(r), ledger)
    assert build is not None
    detail = await Audit(ledger).rollout_detail(r)
    (delivery,) = detail["deliveries"]
    assert delivery["outcome"] == "delivered" and delivery["snapshot_id"] == build["snapshot_id"]
    assert delivery["metrics"]["chains"] == 1 and delivery["handed_off_at"] is not None
    assert delivery["durable_ack_at"] is None
    assert await retire_rollout_token_capture(r, ledger, build)
    detail = await Audit(ledger).rollout_detail(r)
    assert detail["deliveries"][0]["durable_ack_at"] is not None
    assert detail["deliveries"][0]["retired_at"] is not None


@pytest.mark.parametrize("which", ["first", "middle"])
async def test_retry_of_an_extended_call_keeps_the_extended_sibling(
    ledger: Ledger, rid: Rid, which: str
) -> None:
    r = rid("retry")
    s = Scripted(ledger, r)
    ctx = list(SYS)
    if which == "middle":
        ctx = await s.call("c0", ctx, [2000, 2001])
        ctx = [*ctx, 3000]
    # The harness retried this call: same prompt, different generation; it continued the retry.
    await s.call("try1", ctx, [2100, 2101])
    kept = await s.call("try2", ctx, [2200, 2201, 2202])
    await s.call("next", [*kept, 3100], [2300])
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and build["outcome"] == "delivered", build["mask_reasons"]
    m = result["_ng_token_capture"]
    assert m["quarantined_calls"] == 1 and m["chains"] == 1
    assert m["delivered_fraction"] < 1.0
    detail = await Audit(ledger).rollout_detail(r)
    assert [(q["model_call_id"], q["reason"]) for q in detail["quarantines"]] == [
        ("try1", "retry_not_kept")
    ]
    assert detail["quarantines"][0]["delivery_id"] == build["delivery_id"]
    seq = [*kept, 3100, 2300]
    last = carriers(result)[-1]
    assert [*last["prompt_token_ids"], *last["generation_token_ids"]] == seq


async def test_unresolved_retry_of_the_final_call_masks(ledger: Ledger, rid: Rid) -> None:
    r = rid("finalretry")
    s = Scripted(ledger, r)
    ctx = await s.call("c0", list(SYS), [2000])
    ctx = [*ctx, 3000]
    await s.call("last-a", ctx, [2100])
    await s.call("last-b", ctx, [2200])
    result = result_for(r, response={"output": []})
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and result["mask_sample"] is True
    assert "unresolved_retry" in build["mask_reasons"]
    assert not await retire_rollout_token_capture(r, ledger, build)
    assert (await ledger.get_state(r)).state == "frozen"  # kept for diagnosis


async def test_final_retry_resolved_by_response_id(ledger: Ledger, rid: Rid) -> None:
    r = rid("finalretry-attr")
    s = Scripted(ledger, r)
    ctx = await s.call("c0", list(SYS), [2000])
    ctx = [*ctx, 3000]
    await s.call("last-a", ctx, [2100], response_id="chatcmpl-A")
    await s.call("last-b", ctx, [2200], response_id="chatcmpl-B")
    result = result_for(r, response={"id": "chatcmpl-B", "output": []})
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and build["outcome"] == "delivered", build["mask_reasons"]
    assert result["_ng_token_capture"]["terminal_attribution"]["method"] == "response_id"
    assert carriers(result)[-1]["generation_token_ids"] == [2200]


async def test_compaction_starts_a_new_root(ledger: Ledger, rid: Rid) -> None:
    r = rid("compact")
    s = Scripted(ledger, r)
    await tool_loop(s, 3, prefix="pre")
    # The harness summarised the history: a rewritten prompt that extends nothing.
    ctx = await s.call("post0", [*SYS[:10], 7777, 7778], [4000, 4001], response_id="chatcmpl-p0")
    await s.call("post1", [*ctx, 3999], [4100], response_id="chatcmpl-final")
    unattributed = result_for(r, response={"output": []})
    build = await finalize_rollout_token_capture(unattributed, ledger)
    assert build is not None and unattributed["mask_sample"] is True
    assert "multiple_chains_unattributed" in build["mask_reasons"]
    assert unattributed["_ng_token_capture"]["chains"] == 2
    attributed = result_for(r, response={"id": "chatcmpl-final", "output": []})
    build = await finalize_rollout_token_capture(attributed, ledger)
    assert build is not None and build["outcome"] == "delivered"
    assert attributed["_ng_token_capture"]["terminal_attribution"]["chain"] == "delivered"
    assert [c["generation_token_ids"] for c in carriers(attributed)] == [[4000, 4001], [4100]]


async def test_sub_agent_side_chain_excluded_when_terminal_attributed(
    ledger: Ledger, rid: Rid
) -> None:
    r = rid("subagent")
    s = Scripted(ledger, r)
    ctx = await s.call("main0", list(SYS), [2000, 2001])
    await s.call("sub0", [5000, 5001, 5002], [5100, 5101, 5102, 5103])  # sub-agent, own root
    await s.call("sub1", [5000, 5001, 5002, 5100, 5101, 5102, 5103, 5200], [5300])
    await s.call("main1", [*ctx, 3000], [2100], response_id="chatcmpl-main-final")
    result = result_for(r, _ng_terminal_model_call_id="main1")
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and build["outcome"] == "delivered"
    m = result["_ng_token_capture"]
    assert m["chains"] == 2 and 0 < m["delivered_fraction"] < 1
    assert m["terminal_attribution"]["method"] == "explicit"
    assert [c["generation_token_ids"] for c in carriers(result)] == [[2000, 2001], [2100]]


async def test_title_side_call_before_first_real_call(ledger: Ledger, rid: Rid) -> None:
    r = rid("title")
    s = Scripted(ledger, r)
    await s.call("title", [6000, 6001], [6100, 6101], text="Weather chat")
    ctx = await s.call("c0", list(SYS), [2000])
    await s.call("c1", [*ctx, 3000], [2100], response_id="chatcmpl-final")
    masked = result_for(r, response={"output": []})
    build = await finalize_rollout_token_capture(masked, ledger)
    assert build is not None and "multiple_chains_unattributed" in build["mask_reasons"]
    ok = result_for(r, response={"id": "chatcmpl-final", "output": []})
    build = await finalize_rollout_token_capture(ok, ledger)
    assert build is not None and build["outcome"] == "delivered"
    assert ok["_ng_token_capture"]["delivered_fraction"] == round(2 / 4, 4)


async def test_identical_candidate_parents_collapse(ledger: Ledger, rid: Rid) -> None:
    r = rid("identical")
    s = Scripted(ledger, r)
    ctx = await s.call("a-first", list(SYS), [2000, 2001])
    await s.call("b-dup", list(SYS), [2000, 2001])  # a retry that sampled the same tokens
    await s.call("child", [*ctx, 3000], [2100])
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and build["outcome"] == "delivered", build["mask_reasons"]
    assert [c["generation_token_ids"] for c in carriers(result)] == [[2000, 2001], [2100]]


async def test_only_empty_generations_mask(ledger: Ledger, rid: Rid) -> None:
    r = rid("empties")
    s = Scripted(ledger, r)
    await s.call("e0", list(SYS), [])
    await s.call("e1", list(SYS), [])
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and result["mask_sample"] is True
    assert result["_ng_token_capture"]["empty_generation_calls"] == 2


async def test_incomplete_capture_masks(ledger: Ledger, rid: Rid) -> None:
    r = rid("incomplete")
    s = Scripted(ledger, r)
    await tool_loop(s, 2)
    await ledger.begin_call(r, "lost")  # dispatched, never recorded
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and result["mask_sample"] is True
    assert build["mask_reasons"][0] == "capture_incomplete"
    assert result["_ng_token_capture"]["capture_incomplete"] is True
    assert "dangling_intent" in result["_ng_token_capture"]["incomplete_reasons"]
    assert not await retire_rollout_token_capture(r, ledger, build)


async def test_no_records_masks_with_error(ledger: Ledger, rid: Rid) -> None:
    r = rid("nothing")
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and result["mask_sample"] is True
    assert result["_ng_token_capture"]["n_calls"] == 0
    assert "no token records" in result["_ng_token_capture"]["error"]


class RaisingSource:
    async def finalize(self, result: dict[str, Any], **_: Any) -> dict[str, Any]:
        raise ConnectionError("ledger unreachable")


async def test_source_that_raises_masks_and_never_raises() -> None:
    result = result_for("r-raises-1")
    build = await finalize_rollout_token_capture(result, RaisingSource())
    assert build is not None and result["mask_sample"] is True
    assert result["_ng_token_capture"]["error"] == "ConnectionError: ledger unreachable"


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"_ng_rollout_id": "bad id!"}, "malformed rollout id"),
        ({"reward": 0.0}, "no capture key"),
    ],
)
async def test_bad_capture_keys_mask(ledger: Ledger, row: dict[str, Any], needle: str) -> None:
    result = {"response": {"output": []}, **row}
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and result["mask_sample"] is True
    assert needle in result["_ng_token_capture"]["error"]


async def test_result_with_native_token_ids_is_left_unchanged(ledger: Ledger, rid: Rid) -> None:
    r = rid("native")
    s = Scripted(ledger, r)
    await tool_loop(s, 1)
    result = result_for(r)
    result["response"]["output"][0].update(
        {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.1]}
    )
    before = copy.deepcopy(result)
    build = await finalize_rollout_token_capture(result, ledger)
    assert result == before
    assert build is not None and build["outcome"] == "redundant"
    assert (await ledger.get_state(r)).state == "frozen"  # late writes are fenced
    assert await retire_rollout_token_capture(r, ledger, build)


async def test_finalize_twice_is_stable(ledger: Ledger, rid: Rid) -> None:
    r = rid("twice")
    s = Scripted(ledger, r)
    await tool_loop(s, 2)
    result = result_for(r)
    first = await finalize_rollout_token_capture(result, ledger)
    again = await finalize_rollout_token_capture(result, ledger)  # output now carries tokens
    assert first is not None and again is not None
    assert again["outcome"] == "redundant" and again["snapshot_id"] == first["snapshot_id"]


async def test_masked_builds_are_never_retired(ledger: Ledger, rid: Rid) -> None:
    r = rid("keep")
    s = Scripted(ledger, r)
    await tool_loop(s, 1)
    await ledger.mark_incomplete(r, reason="upstream_error")
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and build["mask_sample"]
    assert not await retire_rollout_token_capture(r, ledger, build)
    forged = {**build, "mask_sample": False, "outcome": "delivered"}
    forged["version"] = build["version"] - 1
    assert not await retire_rollout_token_capture(r, ledger, forged)


@pytest.mark.slow
async def test_thousand_call_rollout_builds(ledger: Ledger, rid: Rid) -> None:
    r = rid("long")
    s = Scripted(ledger, r)
    ctx = [1, 2, 3]
    for i in range(1000):
        ctx = await s.call(f"c{i:04d}", ctx, [10_000 + i], items=[], intent=False)
        ctx = [*ctx, 5]
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and build["outcome"] == "delivered", build["mask_reasons"]
    cs = carriers(result)
    assert len(cs) == 1000
    assert cs[-1]["generation_token_ids"] == [10_999]
    assert len(cs[-1]["prompt_token_ids"]) == 3 + 999 * 2


async def test_all_chains_mode_emits_every_chain_with_roles(ledger: Ledger, rid: Rid) -> None:
    r = rid("allchains")
    s = Scripted(ledger, r)
    await s.call("title", [6000, 6001], [6100, 6101])
    ctx = await s.call("c0", list(SYS), [2000])
    await s.call("c1", [*ctx, 3000], [2100], response_id="chatcmpl-final")
    result = result_for(r, response={"id": "chatcmpl-final", "output": []})
    build = await finalize_rollout_token_capture(result, ledger, deliver="all-chains")
    assert build is not None and build["outcome"] == "delivered"
    roles = sorted((t["label"], t["role"]) for t in build["trajectories"])
    assert roles == [("branch-0", "side"), ("main", "terminal")]
    for t in build["trajectories"]:
        assert_prefix_contiguous(t["response"])
