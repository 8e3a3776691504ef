"""The writer's recorded parent decision (NeMo Gym 0.7.0's request-time lineage), read at ingest.

A record written by NeMo Gym's model server carries the parent decision its lineage resolver
made before the call was dispatched: ``parent_resolution`` (``root``, ``resolved`` or
``unresolved``) with ``parent_call_id`` for ``resolved``, the length and digest of the full
prompt + generation (``cum_len``, ``digest``), and, with ``delta_records``, a prompt that holds
only the suffix after the parent (``prompt_is_delta``).  The ledger keeps proving every link by
tokens; the recorded decision says *which* link may be proven:

- ``root``: the request had no model-authored history; the call is a root even if an earlier
  call's tokens happen to prefix its prompt (a sub-agent that starts from the same text is not
  a continuation).
- ``resolved``: the named parent is the only candidate; the link is verified if the prompt
  extends that parent's cumulative tokens, and a boundary (``parent_digest_mismatch``) if not.
  A parent the ledger never received is recovered by token prefix, as NeMo Gym's builder does,
  else it is a boundary (``parent_call_id_missing``).
- ``unresolved``: the request continues history no captured call explains (a turn that was
  never captured, a rewritten history, a changed system prompt or tool list): a boundary
  (``parent_unresolved``), never linked, whatever the tokens say.  A token prefix alone cannot
  tell a clean continuation from one whose interstitial holds an uncaptured call's sampled
  tokens.

A record without any decision (the ledger's own proxy, older writers) keeps the ledger's own
token-prefix proof.

The digest is NeMo Gym's token digest (its published format, written here from its
specification): SHA-256 over the ASCII domain ``nemo-gym-tokens``, one version byte (1), the
sequence length as 8 bytes big-endian, then every id as 8 bytes big-endian unsigned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ledger.records import gym_token_digest

__all__ = [
    "RecordedDecision",
    "decision_of_stored",
    "gym_token_digest",
    "recorded_decision",
]

DECISIONS = ("root", "resolved", "unresolved")


@dataclass(frozen=True, slots=True)
class RecordedDecision:
    """What the writer recorded about a call's parent; ``status`` is ``root``, ``resolved`` or
    ``unresolved``."""

    status: str
    parent_call_id: str | None = None
    prompt_is_delta: bool = False
    cum_len: int | None = None
    digest: str | None = None


def _field(source: Any, name: str) -> Any:
    """A field of an entry, named or extra, or of a stored ``extra`` mapping."""
    if isinstance(source, Mapping):
        return source.get(name)
    value = getattr(source, name, None)
    if value is None:
        extra = getattr(source, "__pydantic_extra__", None) or {}
        value = extra.get(name)
    return value


def _status(value: Any) -> str | None:
    text = getattr(value, "value", value)
    return text if isinstance(text, str) and text in DECISIONS else None


def recorded_decision(source: Any) -> RecordedDecision | None:
    """The decision an entry (or a stored extra mapping) carries, or ``None`` without one.

    A record that names a parent without a status is read as ``resolved``, as NeMo Gym's
    builder reads it.
    """
    status = _status(_field(source, "parent_resolution"))
    parent = _field(source, "parent_call_id")
    parent = parent if isinstance(parent, str) and parent else None
    if status is None and parent is None:
        return None
    # NeMo Gym's builder reads ``root`` and ``unresolved`` first, then anything naming a parent.
    status = status if status in ("root", "unresolved") else "resolved"
    cum_len = _field(source, "cum_len")
    digest = _field(source, "digest")
    return RecordedDecision(
        status=status,
        parent_call_id=parent if status == "resolved" else None,
        prompt_is_delta=_field(source, "prompt_is_delta") is True,
        cum_len=cum_len if isinstance(cum_len, int) and not isinstance(cum_len, bool) else None,
        digest=digest if isinstance(digest, str) and digest else None,
    )


def decision_of_stored(row: Any) -> RecordedDecision | None:
    """The recorded decision of a stored call row (its columns, else its ``extra`` JSON)."""
    decision = recorded_decision(
        {
            "parent_resolution": getattr(row, "parent_resolution", None),
            "parent_call_id": getattr(row, "recorded_parent_call_id", None),
        }
    )
    if decision is not None:
        return decision
    extra = getattr(row, "extra", None)
    return recorded_decision(extra) if isinstance(extra, Mapping) else None
