"""The record the capture proxy hands the ledger: validated once.

The extractor checks token ids and log-probs with the ledger's own rules (``ledger.token_rules``),
so the proxy builds its ``TokenEntry`` without pydantic checking them again; these tests pin that
the entry it builds is the one full validation builds, and that whatever the extractor did not
check goes through full validation (and so is refused the same way).
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.app import YOUNG_GC_THRESHOLD, create_app
from api.dialects import InvalidRequest
from api.extract import (
    MalformedTokenPayload,
    _id_list,
    extract_chat_tokens,
    extract_completion_tokens,
    strip_chat_response,
)
from api.proxy.capture import _checked_entry, _json_bytes, _token_count
from ledger import migrate
from ledger.config import load_settings
from ledger.records import TokenEntry
from ledger.token_rules import check_token_ids, plain_token_ids
from tests.support.vllm import vllm_chat_answer

PROMPT = [1, 9690, 198, 2683, 359, 2, 198, 1, 520, 9531, 198]
GENERATION = [19556, 30, 2]
LOG_PROBS = [-2.19, -1.53, -0.35]


def _record(payload: Any, items: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The dict ``api.proxy.capture._entry`` builds (same keys, same kinds of values)."""
    record = {
        "schema_version": 1,
        "rollout_id": "roll-1",
        "model_call_id": "0123456789abcdef0123456789abcdef",
        "model": "smol",
        "prompt_token_ids": payload.prompt_token_ids,
        "generation_token_ids": payload.generation_token_ids,
        "generation_log_probs": payload.generation_log_probs,
        "routed_experts": payload.routed_experts,
        "output_items": items,
        "token_item_index": len(items) - 1 if items else None,
        "created_at": 1795940059.25,
        "response_id": "chatcmpl-1",
    }
    record.update(extra)
    return record


def _same_as_validated(record: dict[str, Any]) -> TokenEntry:
    built = _checked_entry(record)
    assert isinstance(built, TokenEntry)
    validated = TokenEntry.model_validate(record)
    assert built.model_dump() == validated.model_dump()
    assert built.__pydantic_extra__ == validated.__pydantic_extra__
    for name in ("prompt_token_ids", "generation_token_ids"):
        assert built.packed_ids(name) == validated.packed_ids(name)
    assert built.extra_fields() == validated.extra_fields()
    return built


def test_a_chat_record_is_the_entry_full_validation_builds() -> None:
    answer = vllm_chat_answer(
        "Hello.", GENERATION, log_probs=LOG_PROBS, finish_reason="stop", prompt_ids=PROMPT
    )
    payload = extract_chat_tokens(answer)
    items = strip_chat_response(answer, keep_logprobs=False).output_items
    _same_as_validated(_record(payload, items))
    # Prefix supply's extra fields (a 0.7.0 lineage flag and an unknown extra) are kept alike.
    entry = _same_as_validated(
        _record(payload, items, prefix_requested=True, prefix_context_digest="ab" * 32)
    )
    assert entry.prefix_requested is True


def test_a_completion_record_with_minus_infinity_is_the_same_entry() -> None:
    answer = {
        "id": "cmpl-1",
        "model": "smol",
        "choices": [
            {
                "index": 0,
                "text": "Hello.",
                "logprobs": {
                    "tokens": [f"token_id:{i}" for i in GENERATION],
                    "token_logprobs": [-2.19, "-Infinity", -0.35],
                },
                "finish_reason": "stop",
                "token_ids": GENERATION,
                "prompt_token_ids": PROMPT,
            }
        ],
    }
    payload = extract_completion_tokens(answer)
    assert math.isinf(payload.generation_log_probs[1])
    _same_as_validated(_record(payload, [{"type": "message", "role": "assistant"}]))


@pytest.mark.parametrize(
    "change",
    [
        {"rollout_id": "bad id\n"},
        {"model_call_id": ""},
        {"token_item_index": 5},
        {"created_at": math.nan},
        {"created_at": 1e308},
        {"generation_log_probs": [-1.0]},
    ],
)
def test_what_the_extractor_did_not_check_gets_full_validation(change: dict[str, Any]) -> None:
    answer = vllm_chat_answer(
        "Hello.", GENERATION, log_probs=LOG_PROBS, finish_reason="stop", prompt_ids=PROMPT
    )
    payload = extract_chat_tokens(answer)
    record = _record(payload, [{"type": "message"}], **change)
    assert _checked_entry(record) is record  # a dict: ``put`` validates it and refuses it
    with pytest.raises(ValueError):
        TokenEntry.model_validate(record)


def test_logprob_token_ids_beyond_int32_are_malformed() -> None:
    answer = {
        "id": "cmpl-1",
        "model": "smol",
        "choices": [
            {
                "index": 0,
                "text": "x",
                "logprobs": {"tokens": [f"token_id:{2**31}"], "token_logprobs": [-0.5]},
                "finish_reason": "stop",
            }
        ],
    }
    with pytest.raises(MalformedTokenPayload, match="int32"):
        extract_completion_tokens(answer)


_ITEMS = st.one_of(
    st.integers(min_value=0, max_value=2**31 + 5),
    st.integers(min_value=-(2**40), max_value=2**70),
    st.sampled_from([True, False, None, 7.0, "7", -0, 10**9 - 1, 10**9, 2**31 - 1, 2**31]),
    st.lists(st.integers(0, 5), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ITEMS, max_size=12))
def test_the_fast_id_check_accepts_only_what_the_token_rules_accept(ids: list[Any]) -> None:
    try:
        check_token_ids(ids, "ids")
    except ValueError:
        allowed = False
    else:
        allowed = True
    if plain_token_ids(ids):
        assert allowed
    if allowed:
        assert _id_list(ids, "ids") == ids
    else:
        with pytest.raises(MalformedTokenPayload):
            _id_list(ids, "ids")


def test_the_fast_id_check_takes_long_plain_prompts() -> None:
    ids = [(i * 7919) % 151_000 for i in range(16_000)]
    assert plain_token_ids(ids) and plain_token_ids([]) and plain_token_ids([999_999_999])
    assert (
        not plain_token_ids([*ids, True])
        and not plain_token_ids([1, -1])
        and not plain_token_ids([2**31])
    )


async def test_serve_moves_the_started_heap_out_of_the_collectors_way(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'gc.db'}"
    migrate.upgrade(url)
    settings = load_settings(db=url)
    assert gc.get_freeze_count() == 0
    plain = create_app(settings)
    async with plain.router.lifespan_context(plain):
        assert gc.get_freeze_count() == 0  # tests and embedders: nothing frozen
    threshold = gc.get_threshold()
    served = create_app(settings, freeze_gc=True)
    try:
        async with served.router.lifespan_context(served):
            assert gc.get_freeze_count() > 1000  # the started heap
            # The young generation is collected less often while it serves, then as before.
            assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, *threshold[1:])
            assert threshold[0] < YOUNG_GC_THRESHOLD
        assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_the_token_count_that_sends_long_answers_to_a_worker_thread() -> None:
    chat = vllm_chat_answer(
        "Hello.", GENERATION, log_probs=LOG_PROBS, finish_reason="stop", prompt_ids=PROMPT
    )
    assert _token_count(chat) == len(PROMPT)
    completion = {"choices": [{"prompt_token_ids": PROMPT, "token_ids": GENERATION}]}
    assert _token_count(completion) == len(PROMPT)
    assert _token_count({"choices": []}) == 0 and _token_count({"prompt_token_ids": None}) == 0


def test_the_upstream_body_is_the_stdlibs_compact_json_and_refuses_the_same_values() -> None:
    body = {"model": "smol", "messages": [{"role": "user", "content": "héllo ✓"}], "n": None}
    assert _json_bytes(body) == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8"
    )
    assert _json_bytes({1: "a"}) == b'{"1":"a"}'  # a non-string key: the stdlib's text
    for bad in ({"temperature": math.nan}, {"x": [math.inf]}, {"content": "\ud800"}):
        with pytest.raises(InvalidRequest):
            _json_bytes(bad)
