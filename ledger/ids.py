"""Rollout id rules (design §5.1)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ledger.errors import InvalidRolloutId

MAX_ROLLOUT_ID_LEN = 200
MAX_CALL_ID_LEN = 200
# \Z, not $: "$" also matches before a trailing newline, and "nl-1\n" must not be an id.
_ID_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*\Z")
ALLOWED_ID_TEXT = "letters, digits, dots, dashes or underscores, starting with a letter or digit"


def is_valid_id(value: object, max_len: int = MAX_ROLLOUT_ID_LEN) -> bool:
    return isinstance(value, str) and len(value) <= max_len and bool(_ID_RE.match(value))


def validate_rollout_id(value: object) -> str:
    """Return ``value`` if it is a valid rollout id; raise ``InvalidRolloutId`` otherwise.

    Ids are never sanitized: a malformed id is an error the caller must see.
    """
    if not is_valid_id(value):
        raise InvalidRolloutId(
            f"rollout id must be {ALLOWED_ID_TEXT} (at most {MAX_ROLLOUT_ID_LEN} characters);"
            f" got {value!r}"
        )
    assert isinstance(value, str)
    return value


def validate_call_id(value: object) -> str:
    if not is_valid_id(value, MAX_CALL_ID_LEN):
        raise InvalidRolloutId(
            f"model_call_id must be {ALLOWED_ID_TEXT} (at most {MAX_CALL_ID_LEN} characters);"
            f" got {value!r}"
        )
    assert isinstance(value, str)
    return value


def rollout_id_from_run_body(body: Mapping[str, Any]) -> str | None:
    """The capture key of a run request or rollout result, or ``None`` if it has none.

    Derived exactly as NeMo Gym 0.7.0 derives it: the explicit ``_ng_rollout_id`` if present
    (a malformed one is an error, never sanitized), otherwise
    ``"{_ng_task_index}-{_ng_rollout_index}"``; in both cases an ``_ng_attempt_index`` above 0
    appends ``-a{n}``, so every re-dispatch attempt has its own records.
    """
    explicit = body.get("_ng_rollout_id")
    if explicit is not None:
        rid = validate_rollout_id(explicit)
    else:
        task, rollout = body.get("_ng_task_index"), body.get("_ng_rollout_index")
        if task is None or rollout is None:
            return None
        rid = f"{task}-{rollout}"
    attempt = body.get("_ng_attempt_index")
    if attempt is not None:
        try:
            n = int(attempt)
        except (TypeError, ValueError):
            raise InvalidRolloutId(
                f"_ng_attempt_index must be an integer; got {attempt!r}"
            ) from None
        if n > 0:
            rid = f"{rid}-a{n}"
    return validate_rollout_id(rid)
