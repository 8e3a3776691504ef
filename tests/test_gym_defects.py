"""Regression tests for the wrong data found against NeMo Gym 0.7.0 (issue 10, point 5).

Each test names the defect it pins (5a ... 5i) and runs on SQLite and Postgres.  Records are
written the way NeMo Gym 0.7.0's model server writes them: with the request-time parent decision
(``parent_resolution``, ``parent_call_id``), the full-sequence ``cum_len``/``digest`` and, with
``delta_records``, a prompt that holds only the suffix after the parent.  Where the released wheel
is cached, the decisions are also checked against the release's own builder.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledger.collect import collect
from ledger.delivery import finalize_rollout_token_capture
from ledger.errors import InvalidRecord, InvalidRolloutId, LedgerError
from ledger.gym import CaptureSink, CaptureSource
from ledger.gym_lineage import gym_view
from ledger.ids import rollout_id_from_run_body
from ledger.records import gym_token_digest
from ledger.store import Ledger
from tests.support.gym_release import release_dir
from tests.test_remote import Service, _serve

Rid = Callable[[str], str]


def text_of(call_id: str) -> str:
    return f"answer of {call_id}"


def gym_rec(
    rollout_id: str,
    call_id: str,
    prompt: list[int],
    gen: list[int],
    *,
    decision: str | None = "root",
    parent: str | None = None,
    parent_cumulative: list[int] | None = None,
    created_at: float = 1_700_000_000.0,
    log_probs: list[float] | None = None,
    text: str | None = None,
) -> dict[str, Any]:
    """A record as NeMo Gym 0.7.0's ``commit_entry`` writes it (``parent_cumulative`` makes
    it a delta record: the prompt is cut after those tokens)."""
    full = [*prompt, *gen]
    stored_prompt, is_delta = prompt, False
    if parent_cumulative is not None:
        assert prompt[: len(parent_cumulative)] == parent_cumulative
        stored_prompt, is_delta = prompt[len(parent_cumulative) :], True
    return {
        "schema_version": 1,
        "rollout_id": rollout_id,
        "model_call_id": call_id,
        "model": "policy",
        "prompt_token_ids": stored_prompt,
        "generation_token_ids": gen,
        "generation_log_probs": log_probs or [-0.5 - 0.01 * i for i in range(len(gen))],
        "output_items": [
            {"type": "message", "role": "assistant", "content": text or text_of(call_id)}
        ],
        "token_item_index": 0,
        "response_id": f"resp-{call_id}",
        "created_at": created_at,
        "parent_call_id": parent,
        "cum_len": len(full),
        "digest": gym_token_digest(full),
        "parent_resolution": decision,
        "parent_resolution_reason": "no_match" if decision == "unresolved" else "",
        "prompt_is_delta": is_delta,
    }


def result_for(rollout_id: str, **extra: Any) -> dict[str, Any]:
    return {"_ng_rollout_id": rollout_id, "response": {"output": []}, **extra}


def delivered_items(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in result["response"]["output"] if i.get("generation_token_ids") is not None]


def sequence(result: dict[str, Any]) -> list[int]:
    items = delivered_items(result)
    return [*items[-1]["prompt_token_ids"], *items[-1]["generation_token_ids"]]


async def put_all(ledger: Ledger, records: list[dict[str, Any]]) -> None:
    for record in records:
        await ledger.put(record)


def release_verdict(records: list[dict[str, Any]], result: dict[str, Any]) -> bool | None:
    """The mask decision of the release's own builder on the same records (None: not cached)."""
    if release_dir() is None:
        return None
    from tests.support.gym_release import load_release

    gym = load_release()
    entries = [gym.records.TokenEntry.model_validate(r) for r in records]
    attribution = result.get("_ng_terminal_model_call_id")
    built = gym.consumer._assemble(
        records[0]["rollout_id"],
        entries,
        "prefix_merging",
        "",
        verified_response=result.get("response") or None,
        explicit_terminal_call_id=attribution,
    )
    return bool(built["mask_sample"])


# ----------------------------------------------------------------------- a tool loop


SYS = [1, 11, 12, 13]
HDR = [2]


def loop(rid: str, n: int, *, delta: bool = False, start: float = 1.0) -> list[dict[str, Any]]:
    """``n`` calls of one conversation, each resolved to the previous one."""
    records: list[dict[str, Any]] = []
    prompt = [*SYS, 20, *HDR]
    cumulative: list[int] | None = None
    for i in range(n):
        cid = f"c{i}"
        gen = [100 + 10 * i, 101 + 10 * i, 3]
        parent = records[-1]["model_call_id"] if records else None
        records.append(
            gym_rec(
                rid,
                cid,
                prompt,
                gen,
                decision="resolved" if parent else "root",
                parent=parent,
                parent_cumulative=cumulative if delta and parent else None,
                created_at=1_700_000_000.0 + start + i,
            )
        )
        cumulative = [*prompt, *gen]
        prompt = [*cumulative, 30 + i, 31 + i, *HDR]  # a tool result, then the next header
    return records


# ----------------------------------------------------------------------- 5a


async def test_5a_environment_mask_is_kept_with_its_reason(ledger: Ledger, rid: Rid) -> None:
    r = rid("envmask")
    await put_all(ledger, loop(r, 2))
    result = result_for(r, mask_sample=True, _ng_terminal_model_call_id="c1")
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None
    assert result["mask_sample"] is True  # never cleared
    assert "environment_mask_sample" in result["_ng_token_capture"]["mask_reasons"]
    # The capture itself is healthy: the rebuilt output is there, as NeMo Gym rebuilds it.
    assert build["mask_sample"] is False and delivered_items(result)


async def test_5a_a_capture_mask_finalized_again_is_not_an_environment_mask(
    ledger: Ledger, rid: Rid
) -> None:
    r = rid("refinal")
    await put_all(ledger, loop(r, 2))
    await ledger.mark_incomplete(r, "c1", reason="missing_token_ids", detail="no ids")
    result = result_for(r, _ng_terminal_model_call_id="c1")
    await finalize_rollout_token_capture(result, ledger)
    assert result["mask_sample"] is True
    first = list(result["_ng_token_capture"]["mask_reasons"])
    assert "environment_mask_sample" not in first
    await finalize_rollout_token_capture(result, ledger)  # e.g. a collect over its own output
    assert result["mask_sample"] is True
    assert result["_ng_token_capture"]["mask_reasons"] == first


async def test_5a_collect_writes_the_environment_mask(
    db_url: str, rid: Rid, tmp_path: Path
) -> None:
    r = rid("envcollect")
    ledger = Ledger(db_url)
    try:
        await put_all(ledger, loop(r, 2))
    finally:
        await ledger.close()
    source = CaptureSource(url=db_url)
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps(result_for(r, mask_sample=True)) + "\n")
    try:
        report = await collect(source, rows, tmp_path / "out.jsonl")
    finally:
        await source.close()
    (row,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert row["mask_sample"] is True
    assert "environment_mask_sample" in row["_ng_token_capture"]["mask_reasons"]
    assert report.masked == 1 and report.mask_reasons["environment_mask_sample"] == 1


# ----------------------------------------------------------------------- 5b


def test_5b_attempt_index_scopes_explicit_ids_as_the_release_does() -> None:
    assert rollout_id_from_run_body({"_ng_rollout_id": "job-7", "_ng_attempt_index": 1}) == (
        "job-7-a1"
    )
    assert rollout_id_from_run_body({"_ng_rollout_id": "job-7", "_ng_attempt_index": 0}) == "job-7"
    assert rollout_id_from_run_body({"_ng_task_index": 3, "_ng_rollout_index": 2}) == "3-2"
    body = {"_ng_task_index": 3, "_ng_rollout_index": 2, "_ng_attempt_index": "2"}
    assert rollout_id_from_run_body(body) == "3-2-a2"
    with pytest.raises(InvalidRolloutId):
        rollout_id_from_run_body({"_ng_rollout_id": "job-7", "_ng_attempt_index": "x"})
    if release_dir() is not None:  # the release derives the very same ids
        import sys

        sys.path.insert(0, str(release_dir()))
        try:
            from nemo_gym.rollout_correlation import maybe_rollout_id_from_run_body
        except ImportError:  # its config stack is not importable here
            return
        for case in ({"_ng_rollout_id": "job-7", "_ng_attempt_index": 1}, body):
            assert rollout_id_from_run_body(case) == maybe_rollout_id_from_run_body(case)


async def test_5b_second_attempt_is_not_rebuilt_from_the_first(ledger: Ledger, rid: Rid) -> None:
    r = rid("attempt")
    await put_all(ledger, loop(r, 2))  # attempt 0's records
    retry = result_for(r, _ng_attempt_index=1)
    build = await finalize_rollout_token_capture(retry, ledger)
    assert build is not None and build["rollout_id"] == f"{r}-a1"
    assert retry["mask_sample"] is True and "no_records" in build["mask_reasons"]
    first = result_for(r, _ng_terminal_model_call_id="c1")
    await finalize_rollout_token_capture(first, ledger)
    assert "mask_sample" not in first and sequence(first)[-3:] == [110, 111, 3]
    other = rid("attempt")
    await put_all(ledger, loop(f"{other}-a1", 1))  # what attempt 1's calls were captured under
    second = result_for(other, _ng_attempt_index=1, _ng_terminal_model_call_id="c0")
    await finalize_rollout_token_capture(second, ledger)
    assert "mask_sample" not in second and sequence(second)[-3:] == [100, 101, 3]


# ----------------------------------------------------------------------- 5c


async def test_5c_a_call_put_refused_can_still_be_marked(ledger: Ledger, rid: Rid) -> None:
    r = rid("oddid")
    records = loop(r, 3)
    odd = dict(records[1], model_call_id="run:3:turn:2")
    records[2]["parent_call_id"] = "run:3:turn:2"
    await ledger.put(records[0])
    with pytest.raises(InvalidRecord, match="model_call_id"):
        await ledger.put(odd)
    await ledger.mark_incomplete(r, "run:3:turn:2", reason="capture_failed")
    await ledger.mark_incomplete(r, "x" * 500 + "\x00\ud800", reason="capture_failed")
    await ledger.put(records[2])
    result = result_for(r, _ng_terminal_model_call_id="c2")
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and result["mask_sample"] is True
    assert build["mask_reasons"][0] == "capture_incomplete"
    detail = await ledger_audit_incomplete(ledger, r)
    assert "run:3:turn:2" in detail


async def ledger_audit_incomplete(ledger: Ledger, rollout_id: str) -> list[str]:
    from ledger.store import Audit

    shown = await Audit(ledger).rollout_detail(rollout_id)
    return [e["model_call_id"] for e in shown["incomplete_events"]]


@pytest.fixture
def service(db_url: str) -> Iterator[Service]:
    yield from _serve(db_url)


async def test_5c_marking_any_call_id_over_http(service: Service, rid: Rid) -> None:
    r = rid("oddhttp")
    sink = CaptureSink(url=service.url, token="w-tok")
    source = CaptureSource(url=service.url, token="t-tok")
    try:
        with pytest.raises(LedgerError):  # put refuses the id (422)
            await sink.put(gym_rec(r, "run:3:turn:2", [1, 2], [3]))
        await sink.mark_incomplete(r, "run:3:turn:2")
        await sink.mark_incomplete(r, "y" * 1000)
        assert (await source.freeze(r)).incomplete
    finally:
        await sink.close()
        await source.close()
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.post(
            f"{service.url}/ledger/v1/rollouts/{r}/incomplete",
            json={"model_call_id": "a/b c:d"},
            headers={"Authorization": "Bearer w-tok"},
        )
        assert resp.status_code == 200, resp.text
        # NUL, which neither database stores as sent.  (A lone surrogate is not text: JSON
        # parsing refuses it with a 422 before the ledger sees it; in process it is stored.)
        raw = await client.post(
            f"{service.url}/ledger/v1/rollouts/{r}/incomplete",
            content=b'{"model_call_id": "a\\u0000b"}',
            headers={"Authorization": "Bearer w-tok", "Content-Type": "application/json"},
        )
        assert raw.status_code == 200, raw.text


# ----------------------------------------------------------------------- 5e, 5f


@pytest.mark.parametrize("change", ["rewritten_history", "system_prompt", "tool_list"])
async def test_5e_rewritten_context_is_an_unresolved_boundary(
    ledger: Ledger, rid: Rid, change: str
) -> None:
    """NeMo Gym resolves the rewritten request UNRESOLVED (``no_match``): a boundary that masks,
    also when the final call is attributed, and no token link is made across it."""
    r = rid("rewrite")
    records = loop(r, 2)
    first = records[0]
    prefix = {"rewritten_history": [*SYS, 20, *HDR, 999], "system_prompt": [1, 77, 12, 13]}
    prompt = prefix.get(change, [*SYS, 55, 20, *HDR])  # tools render after the system prompt
    final = gym_rec(r, "c2", [*prompt, 40, *HDR], [120, 3], decision="unresolved")
    await put_all(ledger, [first, final])
    for attributed in (False, True):
        result = result_for(r, **({"_ng_terminal_model_call_id": "c2"} if attributed else {}))
        build = await finalize_rollout_token_capture(result, ledger)
        assert build is not None and result["mask_sample"] is True
        failures = result["_ng_token_capture"]["parent_link_failures"]
        assert failures == {"parent_unresolved": 1}
        assert build["unresolved_parent_calls"] == ["c2"]
        assert release_verdict([first, final], result) in (None, True)


async def test_5e_compaction_is_a_new_root(ledger: Ledger, rid: Rid) -> None:
    r = rid("compact")
    before = loop(r, 2)
    summary = gym_rec(r, "c2", [*SYS, 500, 501, *HDR], [130, 3], created_at=1_700_000_100.0)
    after = gym_rec(
        r,
        "c3",
        [*SYS, 500, 501, *HDR, 130, 3, 60, *HDR],
        [140, 3],
        decision="resolved",
        parent="c2",
        created_at=1_700_000_101.0,
    )
    records = [*before, summary, after]
    await put_all(ledger, records)
    result = result_for(r, _ng_terminal_model_call_id="c3")
    await finalize_rollout_token_capture(result, ledger)
    assert "mask_sample" not in result
    assert sequence(result) == [*SYS, 500, 501, *HDR, 130, 3, 60, *HDR, 140, 3]
    assert result["_ng_token_capture"]["roots"] == 2
    assert release_verdict(records, result) in (None, False)
    unattributed = result_for(r)
    unattributed_build = await finalize_rollout_token_capture(unattributed, ledger)
    assert unattributed_build is not None and unattributed["mask_sample"] is True


async def test_5f_continuation_of_an_uncaptured_turn_masks(ledger: Ledger, rid: Rid) -> None:
    """c1 was never captured; c2's prompt extends c0 by tokens, with c1's sampled tokens in the
    interstitial.  The request resolved UNRESOLVED: no token link, masked."""
    r = rid("hole")
    (c0,) = loop(r, 1)
    c0_cumulative = [*c0["prompt_token_ids"], *c0["generation_token_ids"]]
    hole = [30, *HDR, 777, 778, 3, 31, *HDR]  # c1's generation sits in c2's prompt
    c2 = gym_rec(r, "c2", [*c0_cumulative, *hole], [150, 3], decision="unresolved")
    await put_all(ledger, [c0, c2])
    for extra in ({}, {"_ng_terminal_model_call_id": "c2"}):
        result = result_for(r, **extra)
        build = await finalize_rollout_token_capture(result, ledger)
        assert build is not None and result["mask_sample"] is True
        assert result["_ng_token_capture"]["parent_link_failures"] == {"parent_unresolved": 1}
        assert release_verdict([c0, c2], result) in (None, True)


# ----------------------------------------------------------------------- 5g


async def test_5g_identical_fork_keeps_the_final_answer(ledger: Ledger, rid: Rid) -> None:
    """The main agent's call m2 and a forked sub-agent's a2 sample the same tokens.  The final
    answer m4 continues m2, the sub-agent a3 continues a2 (captured later, smaller id).  The old
    identical-retry rule kept a2 only and delivered the sub-agent's chain unmasked."""
    r = rid("fork")
    (c0,) = loop(r, 1)
    cum0 = [*c0["prompt_token_ids"], *c0["generation_token_ids"]]
    p2 = [*cum0, 30, *HDR]
    m2 = gym_rec(r, "m2", p2, [160, 3], decision="resolved", parent="c0", created_at=2e9)
    m4 = gym_rec(
        r,
        "m4",
        [*p2, 160, 3, 31, *HDR],
        [170, 3],
        decision="resolved",
        parent="m2",
        created_at=2e9 + 1,
    )
    a2 = gym_rec(
        r,
        "a2",
        p2,
        [160, 3],
        decision="resolved",
        parent="c0",
        created_at=2e9 + 2,
        log_probs=[-0.1, -0.2],
    )
    a3 = gym_rec(
        r,
        "a3",
        [*p2, 160, 3, 90, *HDR],
        [180, 3],
        decision="resolved",
        parent="a2",
        created_at=2e9 + 3,
    )
    records = [c0, m2, m4, a2, a3]
    await put_all(ledger, records)
    plain = result_for(r)
    await finalize_rollout_token_capture(plain, ledger)
    assert plain["mask_sample"] is True  # two conversations and nothing says which was scored
    assert plain["_ng_token_capture"]["chains"] == 2
    assert release_verdict(records, plain) in (None, True)
    final = result_for(r, _ng_terminal_model_call_id="m4")
    await finalize_rollout_token_capture(final, ledger)
    assert "mask_sample" not in final
    assert sequence(final)[-2:] == [170, 3]
    # m2's own log-probs, not the sub-agent twin's.
    assert delivered_items(final)[1]["generation_log_probs"] == m2["generation_log_probs"]


async def test_5g_a_recorded_root_is_not_linked_by_a_coincidental_prefix(
    ledger: Ledger, rid: Rid
) -> None:
    r = rid("coincide")
    (c0,) = loop(r, 1)
    cum0 = [*c0["prompt_token_ids"], *c0["generation_token_ids"]]
    # A sub-agent whose first user turn pastes the main conversation's text: a root.
    sub = gym_rec(r, "s1", [*cum0, 40, *HDR], [190, 3], created_at=1_700_000_050.0)
    await put_all(ledger, [c0, sub])
    result = result_for(r, _ng_terminal_model_call_id="s1")
    await finalize_rollout_token_capture(result, ledger)
    assert "mask_sample" not in result
    (only,) = delivered_items(result)  # s1 alone: c0's tokens are context, never a link
    assert only["prompt_token_ids"] == [*cum0, 40, *HDR]
    assert result["_ng_token_capture"]["roots"] == 2


@pytest.mark.parametrize("attributed", [None, "f1", "f2"])
async def test_5g_identical_final_retries_carry_the_delivered_attempts_data(
    ledger: Ledger, rid: Rid, attributed: str | None
) -> None:
    r = rid("idretry")
    records = loop(r, 1)
    cum0 = [*records[0]["prompt_token_ids"], *records[0]["generation_token_ids"]]
    prompt = [*cum0, 30, *HDR]
    for cid, lps, words in (("f1", [-0.3, -0.4], "kept"), ("f2", [-0.31, -0.41], "retried")):
        records.append(
            gym_rec(
                r,
                cid,
                prompt,
                [200, 3],
                decision="resolved",
                parent="c0",
                log_probs=lps,
                text=f"same tokens, {words}",
            )
        )
    await put_all(ledger, records)
    result = result_for(r, **({"_ng_terminal_model_call_id": attributed} if attributed else {}))
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and "mask_sample" not in result
    delivered = attributed or "f1"
    record = next(x for x in records if x["model_call_id"] == delivered)
    last = delivered_items(result)[-1]
    assert last["generation_log_probs"] == record["generation_log_probs"]
    assert last["content"] == record["output_items"][0]["content"]


# ----------------------------------------------------------------------- 5h


async def test_5h_delta_records_are_rebuilt_at_ingest(ledger: Ledger, rid: Rid) -> None:
    r = rid("delta")
    full = loop(r, 3)
    deltas = loop(r, 3, delta=True)
    assert deltas[2]["prompt_is_delta"] and len(deltas[2]["prompt_token_ids"]) == 3
    await put_all(ledger, deltas)
    await ledger.put(deltas[1])  # the identical delta record again: a no-op
    result = result_for(r, _ng_terminal_model_call_id="c2")
    await finalize_rollout_token_capture(result, ledger)
    assert "mask_sample" not in result
    assert sequence(result) == [*full[2]["prompt_token_ids"], *full[2]["generation_token_ids"]]
    snap = await ledger.freeze(r)
    by_id = {e.model_call_id: e for e in snap.entries}
    assert by_id["c2"].prompt_token_ids == full[2]["prompt_token_ids"]
    # The Gym-facing view hands the writer's delta record back exactly as it was put.
    as_put = {e.model_call_id: e for e in gym_view(snap.entries)}
    assert as_put["c2"].prompt_is_delta
    assert as_put["c2"].prompt_token_ids == deltas[2]["prompt_token_ids"]


async def test_5h_a_delta_record_that_cannot_be_rebuilt_is_refused(
    ledger: Ledger, rid: Rid
) -> None:
    r = rid("deltabad")
    deltas = loop(r, 3, delta=True)
    await ledger.put(deltas[0])
    with pytest.raises(InvalidRecord, match=r"delta record .* cannot be reconstructed"):
        await ledger.put(deltas[2])  # its parent c1 never arrived
    await ledger.put(deltas[1])
    wrong = dict(deltas[2], digest=gym_token_digest([5, 6, 7]))
    with pytest.raises(InvalidRecord, match="digest"):
        await ledger.put(wrong)


async def test_5h_delta_records_end_to_end_with_the_release_writer(
    db_url: str, rid: Rid, tmp_path: Path
) -> None:
    if release_dir() is None:
        pytest.skip("the nemo-gym 0.7.0 wheel is not cached")
    import random

    from tests.support.gym_release import Harness, load_release, play

    gym = load_release()
    store = gym.store.TokenCaptureStore(tmp_path / "fs")
    lineage = gym.lineage.FileLineageStore(tmp_path / "fs")
    sink, source = CaptureSink(url=db_url), CaptureSource(url=db_url)
    delivered = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for seed in range(40):
                r = rid(f"deltae2e{seed}")
                h = Harness(
                    gym,
                    random.Random(seed),
                    r,
                    release_store=store,
                    release_lineage=lineage,
                    ledger_sink=sink,
                    delta_records=True,
                )
                result = await play(h)
                built = await gym.consumer.trajectories_from_source(
                    r,
                    store,
                    verified_response=result["response"] or None,
                    explicit_terminal_call_id=result.get("_ng_terminal_model_call_id"),
                    declared_response_id=result.get("terminal_response_id"),
                )
                build = await finalize_rollout_token_capture(result, source)
                assert build is not None
                if not built["mask_sample"] and not build["mask_sample"]:
                    delivered += 1
                    theirs = [
                        i
                        for i in built["rebuilt_response"]["output"]
                        if i.get("generation_token_ids") is not None
                    ]
                    assert delivered_items(result) == theirs
    finally:
        await sink.close()
        await source.close()
    assert delivered >= 10


# ----------------------------------------------------------------------- 5i


async def test_5i_metrics_have_the_release_names_and_meanings(ledger: Ledger, rid: Rid) -> None:
    r = rid("metrics")
    records = loop(r, 2)
    title = gym_rec(r, "t0", [*SYS, 70, *HDR], [300, 301, 302, 3], created_at=1_600_000_000.0)
    records.append(title)
    cum1 = [*records[1]["prompt_token_ids"], *records[1]["generation_token_ids"]]
    for cid, gen in (("f1", [210, 3]), ("f2", [211, 3])):  # an unresolved final retry
        records.append(gym_rec(r, cid, [*cum1, 50, *HDR], gen, decision="resolved", parent="c1"))
    await put_all(ledger, records)
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and result["mask_sample"] is True
    m = result["_ng_token_capture"]
    assert m["quarantined_fraction"] == round(m["quarantined_calls"] / m["n_calls"], 4)
    assert build["unresolved_retries"] == ["f1", "f2"]
    # The main chain of a masked rollout is still counted: the title call's root came first.
    assert m["generated_tokens_delivered"] == 4
    assert m["delivered_fraction"] == round(4 / m["generated_tokens_captured"], 4)
    # A merged transcript: only its trailing model-authored block is c1's own output.
    merged = {
        "_ng_rollout_id": r,
        "response": {
            "output": [
                {"type": "message", "role": "assistant", "content": text_of("c0")},
                {"role": "user", "content": "x"},
                {"type": "message", "role": "assistant", "content": text_of("c1")},
            ]
        },
    }
    fresh = rid("metrics2")
    await put_all(ledger, loop(fresh, 2))
    merged["_ng_rollout_id"] = fresh
    await finalize_rollout_token_capture(merged, ledger)
    assert merged["_ng_token_capture"]["terminal_attribution"]["method"] == "content_output"


async def test_5i_collect_warns_once_per_run_for_malformed_ids(db_url: str, tmp_path: Path) -> None:
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"_ng_rollout_id": f"bad id {i}"}) + "\n" for i in range(3)))
    source = CaptureSource(url=db_url)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = await collect(source, rows, tmp_path / "out.jsonl")
    finally:
        await source.close()
    malformed = [w for w in caught if "malformed rollout id" in str(w.message)]
    assert len(malformed) == 1 and report.masked == 3
    assert report.mask_reasons["malformed_rollout_id"] == 3


async def test_5e_recorded_parent_that_the_tokens_do_not_extend_is_a_boundary(
    ledger: Ledger, rid: Rid
) -> None:
    """NeMo Gym's builder checks a resolved parent by digest; a mismatch is a hard boundary."""
    r = rid("mismatch")
    (c0,) = loop(r, 1)
    # Resolved to c0, but the template re-rendered c0's turn: its tokens are not a prefix.
    c1 = gym_rec(
        r, "c1", [*SYS, 20, *HDR, 101, 100, 3, 30, *HDR], [110, 3], decision="resolved", parent="c0"
    )
    await put_all(ledger, [c0, c1])
    result = result_for(r, _ng_terminal_model_call_id="c1")
    await finalize_rollout_token_capture(result, ledger)
    assert result["mask_sample"] is True
    assert result["_ng_token_capture"]["parent_link_failures"] == {"parent_digest_mismatch": 1}
    assert release_verdict([c0, c1], result) in (None, True)
    from ledger.store import Audit

    edges = (await Audit(ledger).rollout_detail(r))["edges"]
    assert [(e["method"], e["status"], e["mismatch_pos"]) for e in edges] == [
        ("recorded_parent", "drifted", 6)
    ]


def test_gym_token_digest_is_the_releases() -> None:
    if release_dir() is None:
        pytest.skip("the nemo-gym 0.7.0 wheel is not cached")
    from tests.support.gym_release import load_release

    gym = load_release()
    for ids in ([], [0], [1, 2, 3], [2**40, 7], list(range(1000))):
        assert gym_token_digest(ids) == gym.records.compute_digest(ids)
