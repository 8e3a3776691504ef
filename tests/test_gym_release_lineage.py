"""NeMo Gym 0.7.0 records, lineage and any-TokenSource delivery without the release installed
(issue #10 points 1, 2 and 4), on SQLite and Postgres.  ``tests/test_gym_release.py`` proves the
same classes against the released package itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from ledger.delivery import finalize_rollout_token_capture, retire_rollout_token_capture
from ledger.errors import InvalidInput, InvalidRecord, PayloadConflict
from ledger.gym import CaptureLineageStore, CaptureSink, CaptureSource
from ledger.gym_lineage import LineageResolution, stamp_continuation
from ledger.records import ParentResolutionStatus, TokenEntry, gym_token_digest
from ledger.source_build import ingest_order
from ledger.store import Ledger

Rid = Callable[[str], str]
ROOT, RESOLVED, UNRESOLVED = (
    ParentResolutionStatus.ROOT,
    ParentResolutionStatus.RESOLVED,
    ParentResolutionStatus.UNRESOLVED,
)
Q = [{"role": "user", "content": "What is 2+2?"}]


def gym_entry(
    rollout_id: str,
    call_id: str,
    prompt: list[int],
    gen: list[int],
    *,
    request: list[dict[str, Any]] | None = None,
    text: str = "4",
    parent: str | None = None,
    full_prompt: list[int] | None = None,
    stamp: bool = True,
) -> TokenEntry:
    """A record as Gym's ``commit_entry`` writes it (``parent`` + ``full_prompt``: a delta)."""
    entry = TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=[-0.25] * len(gen),
        output_items=[{"type": "message", "role": "assistant", "content": text}],
        token_item_index=0,
        created_at=1.5,
    )
    if stamp:
        stamp_continuation(entry, request if request is not None else Q)
    full = [*(full_prompt if full_prompt is not None else prompt), *gen]
    entry.cum_len, entry.digest = len(full), gym_token_digest(full)
    entry.parent_call_id = parent
    entry.parent_resolution = RESOLVED if parent else ROOT
    entry.prompt_is_delta = full_prompt is not None
    return TokenEntry.model_validate(entry.model_dump())


async def test_a_gym_delta_record_is_proven_on_its_full_prompt_and_frozen_as_put(
    db_url: str, rid: Rid
) -> None:
    r = rid("delta")
    sink, source, led = CaptureSink(url=db_url), CaptureSource(url=db_url), Ledger(db_url)
    try:
        await sink.put(gym_entry(r, "c1", [1, 2, 3], [4, 5]))
        child = gym_entry(r, "c2", [6, 7], [8], parent="c1", full_prompt=[1, 2, 3, 4, 5, 6, 7])
        await sink.put(child)
        await sink.put(child.model_dump())  # the identical record again: a no-op
        # A suffix that does not reproduce the recorded digest, and a missing parent: refused.
        forged = gym_entry(r, "c3", [6, 7], [9], parent="c1", full_prompt=[1, 2, 3, 4, 5, 6, 6])
        with pytest.raises(InvalidRecord, match="do not reproduce"):
            await sink.put(forged)
        orphan = gym_entry(r, "c4", [6], [9], parent="c-gone", full_prompt=[1, 2, 6])
        with pytest.raises(InvalidRecord, match="cannot be reconstructed"):
            await sink.put(orphan)
        views = await led.freeze_views(r)
        assert [(v.model_call_id, v.parent_call_id, v.edge_method) for v in views.calls] == [
            ("c1", None, None),
            ("c2", "c1", "recorded_parent"),  # the writer's decision, proven by tokens
        ]
        full = await led.freeze(r)
        assert [e.prompt_token_ids for e in full.entries] == [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]]
        snap = await source.freeze(r)
        assert [e.model_dump(mode="json") for e in snap.entries] == [
            gym_entry(r, "c1", [1, 2, 3], [4, 5]).model_dump(mode="json"),
            child.model_dump(mode="json"),
        ]
    finally:
        for c in (sink, source):
            await c.close()
        await led.close()


async def test_resolution_follows_the_rule_and_never_guesses(db_url: str, rid: Rid) -> None:
    r = rid("resolve")
    sink, store = CaptureSink(url=db_url), CaptureLineageStore(url=db_url)
    after = [*Q, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    try:
        assert (await store.resolve(r, Q)).status == ROOT  # no model history: no lookup
        assert (await store.resolve(r, after)).reason == "no_match"
        await sink.put(gym_entry(r, "c-unstamped", [1, 2], [3], stamp=False))
        assert (await store.resolve(r, after)).reason == "no_match"  # unstamped: invisible
        await sink.put(gym_entry(r, "c-b", [1, 2], [3]))
        await sink.put(gym_entry(r, "c-a", [1, 2], [3]))  # an identical retry
        res = await store.resolve(r, after)
        assert isinstance(res, LineageResolution) and res.status == RESOLVED
        assert res.match is not None and res.match.model_call_id == "c-a"
        assert res.match.cumulative_token_ids == (1, 2, 3)
        assert res.match.digest == gym_token_digest([1, 2, 3]) and res.match.prev_len == 3
        await sink.put(gym_entry(r, "c-c", [1, 2], [9]))  # same text, other tokens
        assert (await store.resolve(r, after)).reason == "ambiguous"
        rewritten = [{"role": "user", "content": "What is 2+3?"}, *after[1:]]
        assert (await store.resolve(r, rewritten)).reason == "no_match"
        bad = await store.resolve(r, [{"role": "assistant", "content": 7}])
        assert bad.status == UNRESOLVED and bad.reason.startswith("invalid_request_items")
        # The prompt-ids lookup of the proxy is still there, and still proves by tokens.
        by_tokens = await store.resolve_prompt(r, [1, 2, 3, 4])
        assert by_tokens.status == "resolved" and by_tokens.cumulative_token_ids == [1, 2, 3]
    finally:
        await sink.close()
        await store.close()


async def test_a_reused_call_id_is_never_a_parent(db_url: str, rid: Rid) -> None:
    r = rid("reused")
    sink, store = CaptureSink(url=db_url), CaptureLineageStore(url=db_url)
    after = [*Q, {"role": "assistant", "content": "4"}, {"role": "user", "content": "more"}]
    try:
        await sink.put(gym_entry(r, "c1", [1, 2], [3]))
        assert (await store.resolve(r, after)).status == RESOLVED
        with pytest.raises(PayloadConflict):
            await sink.put(gym_entry(r, "c1", [1, 2], [4]))
        res = await store.resolve(r, after)
        assert (res.status, res.reason) == (UNRESOLVED, "no_match")
    finally:
        await sink.close()
        await store.close()


async def test_a_retired_rollout_resolves_unresolved(db_url: str, rid: Rid) -> None:
    r = rid("retired")
    sink, source, store = (
        CaptureSink(url=db_url),
        CaptureSource(url=db_url),
        CaptureLineageStore(url=db_url),
    )
    after = [*Q, {"role": "assistant", "content": "4"}]
    try:
        await sink.put(gym_entry(r, "c1", [1, 2], [3]))
        snap = await source.freeze(r)
        assert await source.drop(r, snapshot_id=snap.snapshot_id, version=snap.version)
        res = await store.resolve(r, after)
        assert (res.status, res.reason) == (UNRESOLVED, "rollout_retired")
    finally:
        for c in (sink, source, store):
            await c.close()


def test_ingest_order_puts_every_parent_first() -> None:
    r = "order-1"
    root = gym_entry(r, "z-root", [1, 2], [3])
    empty = gym_entry(r, "y-empty", [4], [], parent="z-root", full_prompt=[1, 2, 3, 4])
    child = gym_entry(r, "a-child", [], [5], parent="y-empty", full_prompt=[1, 2, 3, 4])
    side = gym_entry(r, "b-side", [1, 2, 3, 4, 9], [6])
    order = [e.model_call_id for e in ingest_order([child, side, empty, root])]
    assert order == ["z-root", "y-empty", "a-child", "b-side"]


@dataclass
class DictSource:
    """A framework's transport, faithful to 0.7.0's ``TokenSource`` (freeze once, conditional
    drop), holding records as plain dicts."""

    records: dict[str, list[dict[str, Any]]]
    incomplete: set[str] = field(default_factory=set)
    frozen: dict[str, tuple[str, int]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    async def freeze(self, rollout_id: str) -> Any:
        ident = self.frozen.setdefault(rollout_id, (f"snap-{rollout_id}", 3))
        return _Snapshot(
            rollout_id,
            tuple(self.records.get(rollout_id, ())),
            rollout_id in self.incomplete,
            *ident,
        )

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        if self.frozen.get(rollout_id) != (snapshot_id, version):
            return False
        self.records.pop(rollout_id, None)
        self.dropped.append(rollout_id)
        return True

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class _Snapshot:
    rollout_id: str
    entries: tuple[Any, ...]
    incomplete: bool
    snapshot_id: str
    version: int


async def test_finalize_builds_from_any_token_source_and_retires_through_drop() -> None:
    r = "31-0"
    c1 = gym_entry(r, "c1", [1, 2, 3], [4, 5])
    c2 = gym_entry(r, "c2", [6], [7, 8], parent="c1", full_prompt=[1, 2, 3, 4, 5, 6])
    source = DictSource({r: [c2.model_dump(), c1.model_dump()]})
    result: dict[str, Any] = {"_ng_task_index": 31, "_ng_rollout_index": 0, "response": {}}
    built = await finalize_rollout_token_capture(result, source)
    assert built is not None and not built["mask_sample"], built["metrics"]
    carriers = [i for i in result["response"]["output"] if i.get("generation_token_ids")]
    assert [(c["prompt_token_ids"], c["generation_token_ids"]) for c in carriers] == [
        ([1, 2, 3], [4, 5]),
        ([1, 2, 3, 4, 5, 6], [7, 8]),
    ]
    assert built["_capture_snapshot"] == {"snapshot_id": f"snap-{r}", "version": 3}
    assert await retire_rollout_token_capture(r, source, built)
    assert source.dropped == [r]


@pytest.mark.parametrize("fault", ["incomplete", "refused_record"])
async def test_a_foreign_snapshot_with_a_hole_masks_and_keeps_its_records(fault: str) -> None:
    r = "32-0"
    records = [gym_entry(r, "c1", [1, 2, 3], [4, 5]).model_dump()]
    if fault == "refused_record":
        records.append({**records[0], "model_call_id": "run:3:turn:2", "generation_token_ids": [9]})
    source = DictSource({r: records}, incomplete={r} if fault == "incomplete" else set())
    result: dict[str, Any] = {"_ng_rollout_id": r, "response": {}}
    built = await finalize_rollout_token_capture(result, source)
    assert built is not None and built["mask_sample"] and result["mask_sample"] is True
    assert "capture_incomplete" in built["mask_reasons"]
    assert not await retire_rollout_token_capture(r, source, built)
    assert source.records[r] == records


def _commit(rollout_id: str, call_id: str, **record: Any) -> dict[str, Any]:
    """A 0.7.0 ``CaptureLedgerCommit`` as JSON (a text-mode root call)."""
    hexes = {k: f"{n:064x}" for n, k in enumerate(("digest", "extras_digest", "chain_hash"), 1)}
    return {
        "rollout_id": rollout_id,
        "record": {
            "model_call_id": call_id,
            "prev_len": 0,
            "delta_len": 5,
            "cum_len": 5,
            "weight_version": 1,
            "staging_key": f"{rollout_id}/{call_id}",
            "mode": "text",
            "cumulative_hash": f"{99:064x}",
            "response_id": f"resp-{call_id}",
            "fingerprint_version": 2,
            **hexes,
            **record,
        },
        "request_items": Q,
        "response_items": [{"type": "message", "role": "assistant", "content": "4"}],
    }


async def test_capture_ledger_rows_are_write_once_token_free_and_resolvable(
    db_url: str, rid: Rid
) -> None:
    r = rid("custody")
    store = CaptureLineageStore(url=db_url)
    after = [*Q, {"role": "assistant", "content": "4"}, {"role": "user", "content": "why?"}]
    try:
        assert not await store.has_rows(r)
        await store.record(_commit(r, "c1"))
        await store.record(_commit(r, "c1"))  # identical replay
        with pytest.raises(PayloadConflict):
            await store.record(_commit(r, "c1", weight_version=2))
        await store.record_failure(r, "c2", "worker_capture_failed")
        assert await store.has_rows(r)
        manifest = await store.manifest(r)
        assert [x["model_call_id"] for x in manifest["records"]] == ["c1"]
        assert manifest["records"][0]["weight_version"] == 1  # the first row stays
        assert manifest["failures"] == [
            {"schema_version": 2, "model_call_id": "c2", "reason": "worker_capture_failed"}
        ]
        assert "token" not in str(manifest).replace("_token", "")
        res = await store.resolve(r, after)
        assert res.status == RESOLVED and res.match is not None
        assert (res.match.model_call_id, res.match.cumulative_token_ids) == ("c1", ())
        assert (res.match.prev_len, res.match.digest) == (5, f"{99:064x}")
        with pytest.raises(InvalidInput):
            await store.record({**_commit(r, "c3"), "record": {"model_call_id": "c3"}})
    finally:
        await store.close()
