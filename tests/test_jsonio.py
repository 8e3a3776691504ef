"""Parsed JSON copied at C speed (``ledger.jsonio.copy_parsed``): always equal to the value,
whatever orjson alone would change or refuse, and never sharing a container with it."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.jsonio import copy_parsed, has_non_finite

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN, and of the same types throughout."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _containers(value: Any) -> list[int]:
    if isinstance(value, list):
        return [id(value), *(i for v in value for i in _containers(v))]
    if isinstance(value, dict):
        return [id(value), *(i for v in value.values() for i in _containers(v))]
    return []


@given(json_values)
def test_a_copy_is_equal_and_shares_no_container(value: Any) -> None:
    copied = copy_parsed(value)
    assert _same(copied, value)
    assert not set(_containers(copied)) & set(_containers(value))


@pytest.mark.parametrize(
    "value",
    [
        {"logprob": -math.inf, "content": None},  # orjson would write -inf as null
        [math.nan, None],
        {"big": 2**70},  # beyond 64 bits: orjson refuses it
        {"lone": "\ud800"},  # a lone surrogate: orjson refuses it
    ],
)
def test_what_orjson_would_change_or_refuse_is_copied_as_it_is(value: Any) -> None:
    assert _same(copy_parsed(value), value)


def test_non_finite_floats_are_found_anywhere() -> None:
    assert has_non_finite({"a": [1, {"b": math.inf}]})
    assert has_non_finite([math.nan])
    assert not has_non_finite({"a": [1.5, None, "inf"]})
