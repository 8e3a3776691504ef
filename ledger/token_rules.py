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
``max``, ``sum``): a per-token Python loop costs milliseconds on long prompts, and records are
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
    "plain_token_ids",
]

MAX_TOKEN_ID = 2**31 - 1  # ids are stored as int32
MAX_CREATED_AT = 253402300799.0  # 9999-12-31T23:59:59Z
NEG_INF_TEXT = "-Infinity"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# orjson's text of token ids, byte by byte: a digit -> "d", the separator stays, anything else
# -> "x".  Only a flat list of non-negative ``int`` (never a bool) writes digit runs between
# commas: a bool is ``true``, a float has ``.``/``e``, a string quotes, a negative ``-``, a
# nested list brackets.
_ID_TEXT = bytes(
    ord("d") if chr(b) in "0123456789" else ord(",") if chr(b) == "," else ord("x")
    for b in range(256)
)
# Ten digits or more: possibly above ``MAX_TOKEN_ID`` (nine never are).
_TEN_DIGITS = b"d" * 10


def _id_list_shape(value: list[Any]) -> bytes | None:
    """The list's JSON text between its brackets with every digit as ``d``, when it is a flat
    list of non-negative ints; ``None`` otherwise (beyond 64 bits, or not JSON at all too):
    one pass in C."""
    try:
        text = orjson.dumps(value)
    except orjson.JSONEncodeError:
        return None
    shape = text[1:-1].translate(_ID_TEXT)
    return None if b"x" in shape else shape


def plain_token_ids(value: list[Any]) -> bool:
    """True when every item is an ``int`` (never a bool) in ``[0, 10**9)``, so within the token
    id rules, checked in C without ``max``.  False says nothing (:func:`check_token_ids`
    decides): a bool, a float, a negative or a ten-digit number all write other text."""
    shape = _id_list_shape(value)
    return shape is not None and _TEN_DIGITS not in shape


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
    shape = _id_list_shape(value)
    if shape is not None and (
        types_only or packed_next or _TEN_DIGITS not in shape or max(value) <= MAX_TOKEN_ID
    ):
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
    if set(map(type, value)) <= {float, int}:
        # Every value <= 0 and none NaN: the largest is <= 0 and the sum is a number (NaN
        # anywhere makes it NaN; with no +inf, -inf only makes it -inf).
        if types_only:
            return value
        total = sum(value)
        if max(value) <= 0.0 and total == total:
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
