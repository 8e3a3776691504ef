"""TokenEntry accepts NeMo Gym's schema-version-1 records (seed field names)."""

from __future__ import annotations

from typing import Any

import pytest

from ledger.errors import InvalidRecord, UnsupportedSchemaVersion
from ledger.records import TokenEntry, coerce_entry


def gym_record(**over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "schema_version": 1,
        "rollout_id": "3-0",
        "model_call_id": "9f1c2b7e4d5a4c3e8b1f0a2d3c4b5a69",
        "model": "Qwen/Qwen3-4B",
        "prompt_token_ids": [1, 9690, 198],
        "generation_token_ids": [49, 103, 2],
        "generation_log_probs": [-3.0727, -1.2486, -0.01],
        "routed_experts": None,
        "output_items": [{"type": "message", "role": "assistant", "content": []}],
        "token_item_index": 0,
        "created_at": 1700000000.25,
    }
    rec.update(over)
    return rec


def test_schema_v1_record_is_accepted_with_seed_field_names() -> None:
    e = coerce_entry(gym_record())
    assert e.schema_version == 1
    assert e.generation_log_probs == [-3.0727, -1.2486, -0.01]
    assert e.response_id is None


def test_extra_fields_are_kept_and_round_trip() -> None:
    e = coerce_entry(gym_record(harness="claude-code", turn={"n": 3}))
    assert e.extra_fields() == {"harness": "claude-code", "turn": {"n": 3}}
    again = TokenEntry.model_validate_json(e.model_dump_json())
    assert again.model_dump() == e.model_dump()


def test_response_id_is_optional_and_kept() -> None:
    assert coerce_entry(gym_record(response_id="chatcmpl-abc")).response_id == "chatcmpl-abc"


def test_newer_schema_version_is_refused_with_upgrade_advice() -> None:
    with pytest.raises(UnsupportedSchemaVersion, match="upgrade rollout-ledger"):
        coerce_entry(gym_record(schema_version=5))


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"generation_log_probs": [-1.0]}, "same length"),
        ({"token_item_index": 1}, "out of range"),
        ({"token_item_index": -1}, "out of range"),
        ({"rollout_id": "bad/id"}, "rollout id"),
        ({"rollout_id": "-starts-with-dash"}, "rollout id"),
        ({"prompt_token_ids": [2**31]}, "int32"),
        ({"generation_log_probs": [-1.0, float("nan"), -2.0]}, "NaN"),
        ({"schema_version": 0}, ">= 1"),
    ],
)
def test_malformed_records_are_refused(over: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidRecord, match=needle):
        coerce_entry(gym_record(**over))


def test_minus_infinity_log_prob_survives_json() -> None:
    e = coerce_entry(gym_record(generation_log_probs=[-9999.0, float("-inf"), -0.5]))
    back = TokenEntry.model_validate_json(e.model_dump_json())
    assert back.generation_log_probs == [-9999.0, float("-inf"), -0.5]
