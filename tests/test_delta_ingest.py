"""NeMo Gym delta records ingested from the parent's digest-cache tip (issue 12): the same rows
as a delta made whole from the stored chain, and the same refusals, on SQLite and Postgres."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import codec
from ledger.errors import InvalidRecord
from ledger.records import (
    ParentResolutionStatus,
    TokenEntry,
    gym_packed_digest,
    gym_token_digest,
    gym_widen,
)
from ledger.storage import capture
from ledger.store import Ledger

Rid = Callable[[str], str]


# Generation slows down on a loaded machine; what is checked does not.
@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=80))
def test_the_gym_digest_of_packed_ids_is_the_gym_digest(ids: list[int]) -> None:
    assert gym_packed_digest(codec.pack_ids(ids)) == gym_token_digest(ids)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=40),
    st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=40),
)
def test_widening_is_per_id_so_a_prefix_widens_once(head: list[int], tail: list[int]) -> None:
    """The widened form of a sequence is its parts' widened forms end to end: what lets a
    continuation widen only its new tokens for the Gym digest."""
    packed_head, packed_tail = codec.pack_ids(head), codec.pack_ids(tail)
    assert gym_widen(packed_head + packed_tail) == gym_widen(packed_head) + gym_widen(packed_tail)


def record(
    rid: str, cid: str, prompt: list[int], gen: list[int], parent: tuple[str, list[int]] | None
) -> TokenEntry:
    """A record as Gym's ``commit_entry`` stamps it with delta records on."""
    full = [*prompt, *gen]
    fields: dict[str, Any] = {
        "rollout_id": rid,
        "model_call_id": cid,
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-0.5] * len(gen),
        "cum_len": len(full),
        "digest": gym_token_digest(full),
        "parent_resolution": ParentResolutionStatus.ROOT,
    }
    if parent is not None:
        pid, parent_cum = parent
        assert prompt[: len(parent_cum)] == parent_cum
        fields |= {
            "prompt_token_ids": prompt[len(parent_cum) :],
            "prompt_is_delta": True,
            "parent_call_id": pid,
            "parent_resolution": ParentResolutionStatus.RESOLVED,
        }
    return TokenEntry(**fields)


def chain(rid: str, turns: int) -> list[TokenEntry]:
    out: list[TokenEntry] = []
    prompt = list(range(100, 140))
    parent: tuple[str, list[int]] | None = None
    for t in range(turns):
        gen = [1000 + 10 * t + k for k in range(5)]
        cid = f"c{t}"
        out.append(record(rid, cid, prompt, gen, parent))
        parent = (cid, [*prompt, *gen])
        prompt = [*prompt, *gen, 7, 8, 9 + t]
    return out


async def rows(led: Ledger, rid: str) -> list[tuple[Any, ...]]:
    views = await led.freeze_views(rid)
    full = await led.freeze(rid)
    return [(v.model_call_id, v.parent_call_id, v.edge_method) for v in views.calls] + [
        (e.model_call_id, e.prompt_token_ids, e.cum_len, e.digest) for e in full.entries
    ]


async def test_a_delta_from_the_tip_stores_what_a_delta_rebuilt_from_the_store_does(
    db_url: str, rid: Rid
) -> None:
    warm, cold = rid("warm"), rid("cold")
    led = Ledger(db_url)
    try:
        for e in chain(warm, 4):  # every parent's tip is remembered: no read, no token list
            if e.parent_call_id is not None:
                assert led._tips.of_call(warm, e.parent_call_id) is not None
            assert (await led.put(e)).status == "created"
        for e in chain(cold, 4):  # a fresh ledger per call: every delta rebuilt from the store
            fresh = Ledger(db_url)
            try:
                res = await fresh.put(e)
            finally:
                await fresh.close()
            assert res.status == "created"
            assert res.prompt_is_delta == (e.parent_call_id is not None)
        # Re-sent to the ledger that remembers the tips: byte-identical repeats.
        for e in chain(cold, 4):
            assert (await led.put(e)).status == "duplicate"
        got_warm, got_cold = await rows(led, warm), await rows(led, cold)
        assert got_warm == got_cold
        assert got_warm[1][1:] == ("c0", "recorded_parent")
    finally:
        await led.close()


async def test_a_delta_from_the_tip_is_refused_when_it_does_not_reproduce_its_stamp(
    db_url: str, rid: Rid
) -> None:
    r = rid("forged")
    led = Ledger(db_url)
    try:
        first, second = chain(r, 2)
        await led.put(first)
        too_long = second.model_copy(update={"cum_len": (second.cum_len or 0) + 1})
        other_digest = second.model_copy(update={"digest": gym_token_digest([1, 2, 3])})
        for bad in (too_long, other_digest):
            with pytest.raises(InvalidRecord, match="do not reproduce its cum_len/digest"):
                await led.put(bad)
        assert (await led.put(second)).status == "created"
    finally:
        await led.close()


async def test_a_tip_keeps_its_widened_tokens_and_a_forged_digest_is_still_refused(
    db_url: str, rid: Rid
) -> None:
    """A delta record's check leaves its call's tip holding the widened cumulative tokens (its
    child widens only its own tokens); the child's digest is still checked on all of them."""
    r = rid("wide")
    led = Ledger(db_url)
    try:
        entries = chain(r, 4)
        for e in entries[:3]:
            assert (await led.put(e)).status == "created"
        tip = led._tips.of_call(r, "c2")
        assert tip is not None and tip.gym_wide is not None
        assert bytes(tip.gym_wide.view()) == bytes(gym_widen(bytes(tip.cumulative.view())))
        last = entries[3]
        forged = last.model_copy(update={"digest": gym_token_digest([5] * (last.cum_len or 0))})
        with pytest.raises(InvalidRecord, match="do not reproduce its cum_len/digest"):
            await led.put(forged)
        assert (await led.put(last)).status == "created"
    finally:
        await led.close()


async def test_a_delta_beyond_the_offload_size_is_checked_in_a_worker_with_the_same_outcome(
    db_url: str, rid: Rid, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delta record whose context is past ``_OFFLOAD_DELTA_TOKENS`` is packed and checked in a
    worker thread (lowered here to every record): the rows are those of the inline check, and a
    forged digest is refused all the same."""
    inline, threaded = rid("inline"), rid("threaded")
    led = Ledger(db_url)
    try:
        for e in chain(inline, 3):
            assert (await led.put(e)).status == "created"
        workers: list[str] = []
        to_thread = asyncio.to_thread

        async def counted(fn: Callable[..., Any], *args: Any) -> Any:
            workers.append(fn.__name__)
            return await to_thread(fn, *args)

        monkeypatch.setattr(capture, "_OFFLOAD_DELTA_TOKENS", 0)
        monkeypatch.setattr(capture.asyncio, "to_thread", counted)
        entries = chain(threaded, 3)
        forged = entries[2].model_copy(update={"digest": gym_token_digest([4, 5])})
        for e in entries[:2]:
            assert (await led.put(e)).status == "created"
        with pytest.raises(InvalidRecord, match="do not reproduce its cum_len/digest"):
            await led.put(forged)
        assert (await led.put(entries[2])).status == "created"
        assert workers == ["prepare_delta"] * 3  # the root is not a delta record
        got_inline, got_threaded = await rows(led, inline), await rows(led, threaded)
        assert got_inline == got_threaded
    finally:
        await led.close()


async def test_a_chain_shares_one_buffer_and_a_branch_from_an_older_call_reads_its_own(
    db_url: str, rid: Rid
) -> None:
    """The tips of a chain of delta records extend one buffer (a call costs its new tokens, not
    a copy of its context); a branch from an older call (a sibling of a later one) copies it, is
    checked on its own tokens, leaves the chain's tips as they were, and stores what a ledger
    rebuilding it from the store stores."""
    r, cold = rid("shared"), rid("sharedcold")

    def cumulative(entries: list[TokenEntry]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for e in entries:
            base = out[e.parent_call_id] if e.prompt_is_delta and e.parent_call_id else []
            out[e.model_call_id] = [*base, *e.prompt_token_ids, *e.generation_token_ids]
        return out

    def branch(rollout: str) -> list[TokenEntry]:
        c1 = cumulative(chain(rollout, 2))["c1"]
        b2 = [*c1, 55, 56, 66, 67]
        return [
            record(rollout, "b2", [*c1, 55, 56], [66, 67], ("c1", c1)),
            record(rollout, "b3", [*b2, 1], [2], ("b2", b2)),
        ]

    led = Ledger(db_url)
    try:
        for e in chain(r, 4):
            assert (await led.put(e)).status == "created"
        tips = [led._tips.of_call(r, f"c{t}") for t in range(1, 4)]
        assert len({id(t.cumulative.buf) for t in tips if t is not None}) == 1
        assert len({id(t.gym_wide.buf) for t in tips if t is not None and t.gym_wide}) == 1
        for e in branch(r):
            assert (await led.put(e)).status == "created"
        expected = cumulative([*chain(r, 4), *branch(r)])
        for cid in ("c2", "c3", "b2", "b3"):
            tip = led._tips.of_call(r, cid)
            assert tip is not None and tip.gym_wide is not None
            assert codec.unpack_ids(bytes(tip.cumulative.view())) == expected[cid]
            assert bytes(tip.gym_wide.view()) == bytes(gym_widen(codec.pack_ids(expected[cid])))
        for e in [*chain(cold, 4), *branch(cold)]:  # every delta rebuilt from the store
            fresh = Ledger(db_url)
            try:
                assert (await fresh.put(e)).status == "created"
            finally:
                await fresh.close()
        assert await rows(led, r) == await rows(led, cold)
    finally:
        await led.close()
