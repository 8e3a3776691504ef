"""A record's token ids are checked in one C pass (issue 12) and still refused exactly as the
per-token rules say: never a bool, a float, a string, a nested list, a negative id or one beyond
int32, naming the first bad position."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import pytest

from ledger import codec
from ledger.errors import InvalidRecord
from ledger.records import TokenEntry, coerce_entry
from ledger.token_rules import check_token_ids


class Tok(IntEnum):
    A = 5


def record(prompt: list[Any]) -> dict[str, Any]:
    return {
        "rollout_id": "r1",
        "model_call_id": "c1",
        "prompt_token_ids": prompt,
        "generation_token_ids": [3],
        "generation_log_probs": [-0.5],
    }


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (True, "prompt_token_ids[2] is True, not a token id"),
        (7.0, "prompt_token_ids[2] is 7.0, not a token id"),
        ("7", "prompt_token_ids[2] is '7', not a token id"),
        ([7], "prompt_token_ids[2] is [7], not a token id"),
        (None, "prompt_token_ids[2] is None, not a token id"),
        (-1, "prompt_token_ids[2] is -1, not a token id"),
        (2**31, f"prompt_token_ids[2] is {2**31}, not a token id"),
        (2**70, f"prompt_token_ids[2] is {2**70}, not a token id"),
    ],
)
def test_a_bad_id_is_refused_with_its_position(bad: Any, message: str) -> None:
    with pytest.raises(InvalidRecord, match=message.replace("[", r"\[").replace("]", r"\]")):
        coerce_entry(record([1, 2, bad, 4]))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_token_ids([1, 2, bad, 4], "prompt_token_ids")


def test_good_ids_are_kept_as_given_and_packed_once() -> None:
    ids = [0, 1, 2**31 - 1, Tok.A, 151_000]
    entry = coerce_entry(record(ids))
    assert entry.prompt_token_ids == [0, 1, 2**31 - 1, 5, 151_000]
    assert entry.packed_ids("prompt_token_ids") == codec.pack_ids([0, 1, 2**31 - 1, 5, 151_000])
    assert coerce_entry(record([])).prompt_token_ids == []
    # Assigning a new list repacks it.
    entry.prompt_token_ids = [9]
    assert entry.packed_ids("prompt_token_ids") == codec.pack_ids([9])
    assert isinstance(TokenEntry(**record([1])), TokenEntry)


def test_types_only_accepts_any_integer_and_refuses_the_rest() -> None:
    assert check_token_ids([-1, 2**40], "p", types_only=True) == [-1, 2**40]
    with pytest.raises(ValueError, match=r"p\[1\] is False"):
        check_token_ids([1, False], "p", types_only=True)
