"""The rules a token record's values must follow, shared by every way in (issue 13, point 7).

HTTP ingest, Python callers (``TokenEntry``) and the capture proxy's extractor all check with
these functions, so a record the proxy would refuse cannot be ingested another way:

* token ids are integers (never ``true``, never ``"7"``, never ``7.0``) in ``[0, 2**31)``;
* log-probs are numbers ``<= 0``: finite, or ``-inf`` (a token of probability zero; JSON
  carries it as the string ``"-Infinity"``); never NaN, ``+inf``, positive, a bool or any
  other string;
* ``created_at`` is a finite Unix time between 0 and the end of year 9999.

Each check returns the value as a plain list (or float) or raises ``ValueError`` naming the
first bad position.  The fast paths run in C (one ``orjson`` pass for the ids' types and signs,
``max``, ``filter``): a per-token Python loop costs milliseconds on long prompts, and records are
checked on the hot path.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

__all__ = [
    "MAX_CREATED_AT",
    "MAX_TOKEN_ID",
    "NEG_INF_TEXT",
    "check_created_at",
    "check_log_probs",
    "check_token_ids",
]

MAX_TOKEN_ID = 2**31 - 1  # ids are stored as int32
MAX_CREATED_AT = 253402300799.0  # 9999-12-31T23:59:59Z
NEG_INF_TEXT = "-Infinity"
_NOT_POSITIVE = (0.0).__ge__  # 0 >= x: False for NaN, +inf and positives


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What orjson writes for a flat list of non-negative integers, and nothing else can produce: a
# bool is ``true``, a float has ``.``/``e``, a string quotes, a negative ``-``, a nested list
# brackets (counted apart).
_ID_LIST_TEXT = b"0123456789,[]"


def _non_negative_ints(value: list[Any]) -> bool:
    """True when every element is a non-negative ``int`` (never a bool): one pass in C."""
    try:
        text = orjson.dumps(value)
    except orjson.JSONEncodeError:  # beyond 64 bits, or not JSON at all: the slow path tells
        return False
    return not text.translate(None, _ID_LIST_TEXT) and text.count(b"[") == 1


def check_token_ids(
    value: Any, where: str, *, types_only: bool = False, packed_next: bool = False
) -> list[int]:
    """``value`` as a list of token ids, or ``ValueError`` naming the first bad one.

    ``types_only``: refuse only what is not an integer (a body model's check before pydantic
    could coerce it; the range is the record's to check).  ``packed_next``: the caller packs
    the ids as int32 right after, which refuses an id above the range (and then calls this
    again for the message), so the upper bound is not checked here."""
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of token ids, not {type(value).__name__}")
    if not value:
        return value
    if _non_negative_ints(value) and (types_only or packed_next or max(value) <= MAX_TOKEN_ID):
        return value
    for position, token in enumerate(value):
        if not _is_int(token):
            raise ValueError(
                f"{where}[{position}] is {token!r}, not a token id (an integer, not "
                f"{type(token).__name__})"
            )
        if not types_only and not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(
                f"{where}[{position}] is {token}, not a token id (ids are int32 values in "
                f"[0, {MAX_TOKEN_ID}])"
            )
    return value


def _log_prob(value: Any, where: str, position: int, types_only: bool = False) -> float:
    if value == NEG_INF_TEXT and isinstance(value, str):
        return -math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(
            f"{where}[{position}] is {value!r}, not a number (a log-probability is a number "
            f'<= 0, or "{NEG_INF_TEXT}")'
        )
    number = float(value)
    if not types_only and not number <= 0.0:
        nan = " (NaN)" if math.isnan(number) else ""
        raise ValueError(
            f"{where}[{position}] is {number}, not a log-probability{nan}: it must be <= 0, "
            "finite or -inf"
        )
    return number


def check_log_probs(value: Any, where: str, *, types_only: bool = False) -> list[float]:
    """``value`` as a list of log-probs, or ``ValueError`` naming the first bad one
    (``types_only``: as for :func:`check_token_ids`)."""
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of log-probabilities, not {type(value).__name__}")
    if not value:
        return value
    if set(map(type, value)) <= {float, int} and (
        types_only or len(list(filter(_NOT_POSITIVE, value))) == len(value)
    ):
        return value
    return [_log_prob(item, where, i, types_only) for i, item in enumerate(value)]


def check_created_at(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"created_at must be a Unix time in seconds (a number), not {value!r}")
    number = float(value)
    if not 0.0 <= number <= MAX_CREATED_AT:
        raise ValueError(
            f"created_at is {number}: it must be a Unix time between 0 and {MAX_CREATED_AT:.0f} "
            "(year 9999)"
        )
    return number
