"""A continuation's prompt ids parsed only beyond its rollout's last prompt (issue 12): the
ids the cache gives are exactly those a full parse gives, or it gives nothing and the answer
is parsed whole."""

from __future__ import annotations

import gc
import json
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.proxy.known_prompts import KnownPrompts
from ledger import codec

ids = st.lists(st.integers(min_value=0, max_value=200_000), max_size=30)


def answer(prompt: list[int], *, spaced: bool = False, **extra: Any) -> bytes:
    """A chat answer as vLLM writes it (compact JSON), or with a space after each comma."""
    body = {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "prompt_token_ids": prompt,
        "usage": {"prompt_tokens": len(prompt)},
        **extra,
    }
    return json.dumps(body, separators=(", ", ":")).encode() if spaced else orjson.dumps(body)


def remembered(known: KnownPrompts, rid: str, raw: bytes) -> None:
    """What the proxy does after extraction: keep the answer's ids for the next call."""
    where = known.locate(raw)
    assert where is not None
    prompt = orjson.loads(raw)["prompt_token_ids"]
    known.remember(rid, raw[where[0] : where[1]], prompt, codec.pack_ids(prompt))


def parse(known: KnownPrompts, rid: str, raw: bytes) -> Any:
    where = known.locate(raw)
    return None if where is None else known.parse(rid, raw, where, raw[where[0] : where[1]])


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(ids, ids, ids, st.booleans(), st.booleans())
def test_the_cached_ids_are_what_a_full_parse_gives(
    last: list[int], other: list[int], new: list[int], extend: bool, spaced: bool
) -> None:
    """Whatever the last and the new prompt are (one extending the other, diverging, a last id
    that the new one turns into a longer number), a parse through the cache gives exactly the
    full parse's answer and packed ids when the new prompt extends the last, else nothing."""
    known = KnownPrompts()
    remembered(known, "r", answer(last, spaced=spaced))
    prompt = [*last, *new] if extend else [*other, *new]
    raw = answer(prompt, spaced=spaced)
    parsed = parse(known, "r", raw)
    extends = prompt[: len(last)] == last and (bool(last) or not prompt)
    assert (parsed is not None) == extends
    if parsed is not None:
        assert parsed.answer == orjson.loads(raw)
        assert parsed.reused == len(last)
        assert known.packed(parsed.answer["prompt_token_ids"], parsed) == codec.pack_ids(prompt)


def test_a_continuation_reuses_the_last_prompt_and_a_divergence_does_not() -> None:
    known = KnownPrompts()
    remembered(known, "r", answer([1, 12, 7]))
    parsed = parse(known, "r", answer([1, 12, 7, 30, 4]))
    assert parsed is not None and parsed.reused == 3
    assert parsed.answer["prompt_token_ids"] == [1, 12, 7, 30, 4]
    assert parse(known, "r", answer([1, 12, 70, 4])) is None  # the last id goes on: 7 -> 70
    assert parse(known, "r", answer([1, 13, 7, 4])) is None  # diverges
    assert parse(known, "other", answer([1, 12, 7, 4])) is None  # another rollout
    same = parse(known, "r", answer([1, 12, 7]))  # the same prompt again (a retry)
    assert same is not None and same.answer["prompt_token_ids"] == [1, 12, 7]


def test_ids_not_once_at_the_top_level_are_left_to_the_full_parse() -> None:
    known = KnownPrompts()
    remembered(known, "r", answer([1, 2]))
    more_fields = answer([1, 2, 3], choices_extra=None)
    other_server = json.dumps({"prompt_token_ids": [1, 2, 3]}).encode()  # `": [`: not looked for
    nested = orjson.dumps({"choices": [{"prompt_token_ids": [1, 2, 3]}]})
    both = orjson.dumps({"prompt_token_ids": [1, 2, 3], "message": {"prompt_token_ids": [1]}})
    assert parse(known, "r", nested) is None  # located, but not at the top level
    assert known.locate(both) is None  # the key twice: not looked at
    assert parse(known, "r", more_fields) is not None
    assert known.locate(other_server) is None


def test_the_cache_stays_within_its_byte_budget_oldest_first() -> None:
    known = KnownPrompts(max_bytes=4000)
    for r in range(10):
        remembered(known, f"r{r}", answer(list(range(10))))
    assert known._bytes <= 4000
    assert parse(known, "r9", answer(list(range(11)))) is not None
    assert parse(known, "r0", answer(list(range(11)))) is None


def test_remembered_ids_are_out_of_the_collectors_way() -> None:
    """The cache holds up to ~1.4M ids for as long as a rollout runs: once the collector has
    looked at them, no collection walks them again (a list of them would be walked by every
    full collection)."""
    known = KnownPrompts()
    remembered(known, "r", answer(list(range(5000))))
    gc.collect()
    held = known._prompts["r"].ids
    assert held == tuple(range(5000)) and not gc.is_tracked(held)
    parsed = parse(known, "r", answer(list(range(5003))))
    assert parsed is not None and parsed.answer["prompt_token_ids"] == list(range(5003))
