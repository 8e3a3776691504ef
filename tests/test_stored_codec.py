"""Stored token arrays name their encoding per row: deflated byte planes for ordinary sizes,
plain arrays for small ones and for rows written before the plane codec.  Every read path gives
back the exact tokens and log-probs, whichever encodings a chain mixes (both backends)."""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from ledger import codec
from ledger.store import Ledger
from tests.test_promises import rec

Rid = Callable[[str], str]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(151_000) for _ in range(n)]


def _record(rid: str, cid: str, prompt: list[int], gen: list[int], rng: random.Random) -> Any:
    log_probs = array("f", [-rng.expovariate(1.5) for _ in gen]).tolist()
    return rec(rid, cid, prompt, gen, generation_log_probs=log_probs)


async def _rows(led: Ledger, rid: str) -> dict[str, tuple[str, str]]:
    async with led.engine.connect() as conn:
        rows = await conn.execute(
            sa.text(
                "SELECT c.model_call_id, t.ids_codec, t.log_prob_codec FROM call_tokens t "
                "JOIN calls c ON c.id = t.call_id WHERE c.rollout_id = :r"
            ),
            {"r": rid},
        )
        return {str(r[0]): (str(r[1]), str(r[2])) for r in rows}


async def _store_plain(
    led: Ledger,
    rid: str,
    cid: str,
    prompt: list[int],
    gen: list[int],
    log_probs: list[float],
    prompt_offset: int,
) -> None:
    """Rewrite one call's tokens row as a row from before the plane codec stores it."""
    lp_tag, lp = codec.pack_log_probs(log_probs)
    async with led.engine.begin() as conn:
        await conn.execute(
            sa.text(
                "UPDATE call_tokens SET ids_codec = :ic, log_prob_codec = :lc, prompt_ids = :p, "
                "generation_ids = :g, log_probs = :l WHERE call_id = (SELECT id FROM calls "
                "WHERE rollout_id = :r AND model_call_id = :c)"
            ),
            {
                "ic": codec.IDS_TAG,
                "lc": lp_tag,
                "p": codec.pack_ids(prompt[prompt_offset:]),
                "g": codec.pack_ids(gen),
                "l": lp,
                "r": rid,
                "c": cid,
            },
        )


async def test_chains_mixing_plane_and_plain_rows_read_back_exactly(
    ledger: Ledger, rid: Rid
) -> None:
    r = rid("planes")
    rng = random.Random(11)
    prompt = _ids(rng, 400)
    sent: dict[str, dict[str, Any]] = {}
    for i in range(4):
        cid = f"c{i}"
        entry = _record(r, cid, list(prompt), _ids(rng, 60), rng)
        res = await ledger.put(entry)
        assert res.status == "created" and res.parent_call_id == (f"c{i - 1}" if i else None)
        sent[cid] = entry
        prompt = [*prompt, *entry["generation_token_ids"], *_ids(rng, 30)]
    tiny = _record(r, "tiny", list(range(5)), [1, 2], rng)
    await ledger.put(tiny)
    sent["tiny"] = tiny

    codecs = await _rows(ledger, r)
    assert codecs["c0"] == (codec.IDS_PLANES, codec.LOGPROB_F32_PLANES)
    assert codecs["c2"][0] == codec.IDS_PLANES
    assert codecs["tiny"] == (codec.IDS_TAG, codec.LOGPROB_F32)

    # c1 as an older ledger stored it: plain arrays, its prompt a delta beyond c0.
    c0_len = len(sent["c0"]["prompt_token_ids"]) + len(sent["c0"]["generation_token_ids"])
    c1 = sent["c1"]
    await _store_plain(
        ledger,
        r,
        "c1",
        c1["prompt_token_ids"],
        c1["generation_token_ids"],
        c1["generation_log_probs"],
        c0_len,
    )
    assert (await _rows(ledger, r))["c1"] == (codec.IDS_TAG, codec.LOGPROB_F32)

    # Lineage reads the parent's stored generation and rebuilds cumulative tokens.
    last = sent["c3"]
    cum = [*last["prompt_token_ids"], *last["generation_token_ids"]]
    res = await ledger.put(_record(r, "c4", [*cum, 5, 6, 7], _ids(rng, 20), rng))
    assert res.parent_call_id == "c3" and res.prompt_is_delta
    assert await ledger.cumulative_token_ids(r, "c2") == [
        *sent["c2"]["prompt_token_ids"],
        *sent["c2"]["generation_token_ids"],
    ]

    chain = await ledger.load_chain(r, "c3")
    assert [link.model_call_id for link in chain] == ["c0", "c1", "c2", "c3"]
    for link in chain:
        e = sent[link.model_call_id]
        assert link.generation_token_ids == e["generation_token_ids"]
        assert link.generation_log_probs == e["generation_log_probs"]

    snap = await ledger.freeze(r)
    got = {e.model_call_id: e for e in snap.entries}
    assert not snap.incomplete
    for cid, e in sent.items():
        assert got[cid].prompt_token_ids == e["prompt_token_ids"]
        assert got[cid].generation_token_ids == e["generation_token_ids"]
        assert got[cid].generation_log_probs == e["generation_log_probs"]
