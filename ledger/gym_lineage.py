"""NeMo Gym 0.7.0's request-time lineage: the answer's shape and the rule that picks a parent.

Gym's model server asks its lineage store, before it dispatches a call, which captured call the
request continues: ``resolve(rollout_id, request_items)`` with the harness's unmodified items.
The rule (0.7.0's ``RolloutLineage``), applied here to candidates read from the ledger:

1. Fingerprint the request (``assistant_fingerprint``).  No model-authored item: ``ROOT``
   (nothing is looked up).
2. Candidates are the rollout's committed entries stamped (``stamp_continuation``) with that
   continuation fingerprint, under fingerprint version 2 (or no version), whose recorded context
   verifies: the request has at least ``continuation_context_len`` items and the digest of that
   many leading items equals ``continuation_context_digest`` (an empty recorded digest never
   verifies).  Unstamped entries are invisible.
3. Several candidates with one identical (digest, cum_len) are identical retries: the smallest
   call id stands for them.  Otherwise none is ``UNRESOLVED no_match``, several
   ``UNRESOLVED ambiguous``: the resolver never guesses.
4. One candidate is ``RESOLVED``; the match carries the parent's exact cumulative tokens
   (prompt + generation, materialised through its delta chain and checked against its digest).

A rewritten or summarised history, a changed system prompt or tool list (they sit in the
request envelope, inside the verified context) therefore resolves ``UNRESOLVED``.  The ledger
keeps its own token-prefix proof at ingest as an independent check of every recorded link.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ledger.gym_fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from ledger.records import ParentResolutionStatus, TokenEntry

__all__ = [
    "LineageCandidate",
    "LineageMatch",
    "LineageResolution",
    "choose_parent",
    "gym_view",
    "in_gym_terms",
    "stamp_continuation",
]


@dataclass(frozen=True)
class LineageMatch:
    """A uniquely verified parent (0.7.0's ``LineageMatch``)."""

    model_call_id: str
    cumulative_token_ids: tuple[int, ...]
    digest: str
    staging_chain: tuple[str, ...] = ()
    prev_len: int = 0
    chain_hash: str = ""


@dataclass(frozen=True)
class LineageResolution:
    """One request-time parent decision (0.7.0's ``LineageResolution``): a ``resolved`` status
    carries a match, any other status none."""

    status: StrEnum  # ``ParentResolutionStatus`` (ours, or the release's: see ``in_gym_terms``)
    match: LineageMatch | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.status == ParentResolutionStatus.RESOLVED and self.match is None:
            raise ValueError("a resolved lineage decision requires a match")
        if self.status != ParentResolutionStatus.RESOLVED and self.match is not None:
            raise ValueError(f"a {self.status.value} lineage decision cannot carry a match")

    def as_json(self) -> dict[str, Any]:
        match = self.match
        return {
            "status": self.status.value,
            "reason": self.reason,
            "match": None
            if match is None
            else {
                "model_call_id": match.model_call_id,
                "cumulative_token_ids": list(match.cumulative_token_ids),
                "digest": match.digest,
                "staging_chain": list(match.staging_chain),
                "prev_len": match.prev_len,
                "chain_hash": match.chain_hash,
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LineageResolution:
        raw = data.get("match")
        match = None
        if raw is not None:
            match = LineageMatch(
                model_call_id=str(raw["model_call_id"]),
                cumulative_token_ids=tuple(int(t) for t in raw["cumulative_token_ids"]),
                digest=str(raw["digest"]),
                staging_chain=tuple(str(s) for s in raw.get("staging_chain") or ()),
                prev_len=int(raw.get("prev_len") or 0),
                chain_hash=str(raw.get("chain_hash") or ""),
            )
        return cls(ParentResolutionStatus(data["status"]), match, str(data.get("reason") or ""))


@dataclass(frozen=True, slots=True)
class LineageCandidate:
    """A committed entry indexed under the request's fingerprint (metadata only)."""

    model_call_id: str
    cum_len: int
    digest: str
    context_len: int
    context_digest: str
    fingerprint_version: int | None


def in_gym_terms(resolution: LineageResolution) -> LineageResolution:
    """``resolution`` with the release's own status enum when Gym is running in this process.

    Gym's serving path copies ``status`` into its pydantic ``TokenEntry`` without validation;
    a value of another enum class would make pydantic warn on every serialisation.  Only an
    already imported release is used: the ledger never imports Gym.
    """
    records = sys.modules.get("nemo_gym.token_id_capture.records")
    native = getattr(records, "ParentResolutionStatus", None)
    if native is None or isinstance(resolution.status, native):
        return resolution
    return dataclasses.replace(resolution, status=native(resolution.status.value))


def stamp_continuation(entry: TokenEntry, request_items: Sequence[Any]) -> TokenEntry:
    """Stamp the continuation metadata a later request is resolved against (before ``put``)."""
    items = list(request_items)
    entry.continuation_fingerprint = assistant_fingerprint([*items, *entry.output_items])
    entry.continuation_context_len = len(items)
    entry.continuation_context_digest = conversation_digest(items)
    entry.fingerprint_version = FINGERPRINT_VERSION
    return entry


def choose_parent(
    request_items: Sequence[Any], candidates: Iterable[LineageCandidate]
) -> tuple[ParentResolutionStatus, LineageCandidate | None, str]:
    """The decision for a request among the entries stamped with its fingerprint."""
    items = list(request_items)
    verified: dict[str, LineageCandidate] = {}
    digests: dict[int, str] = {}
    for c in candidates:
        if c.fingerprint_version not in (None, FINGERPRINT_VERSION):
            continue
        if not c.context_digest or len(items) < c.context_len:
            continue
        if c.context_len not in digests:
            digests[c.context_len] = conversation_digest(items[: c.context_len])
        if digests[c.context_len] == c.context_digest:
            verified.setdefault(c.model_call_id, c)
    found = sorted(verified.values(), key=lambda c: c.model_call_id)
    if len(found) > 1 and found[0].digest and len({(c.digest, c.cum_len) for c in found}) == 1:
        found = found[:1]  # identical retries are interchangeable
    if not found:
        return ParentResolutionStatus.UNRESOLVED, None, "no_match"
    if len(found) > 1:
        return ParentResolutionStatus.UNRESOLVED, None, "ambiguous"
    return ParentResolutionStatus.RESOLVED, found[0], ""


def gym_view(entries: Sequence[TokenEntry]) -> tuple[TokenEntry, ...]:
    """Entries as they were put: a Gym delta record gets its suffix prompt back.

    The ledger stores every prompt in full (a delta record is materialised through its parent
    at ingest, so the ledger's own proof sees real prompts); ``freeze`` hands Gym back exactly
    what its writer stored, which is what the release's builder expects.  A delta entry whose
    parent is not in the snapshot is left out (it cannot be re-cut; the rollout was already
    marked incomplete when its chain broke).
    """
    full_len = {
        e.model_call_id: len(e.prompt_token_ids) + len(e.generation_token_ids) for e in entries
    }
    out: list[TokenEntry] = []
    for e in entries:
        if not e.prompt_is_delta:
            out.append(e)
            continue
        base = full_len.get(e.parent_call_id or "")
        if base is None or base > len(e.prompt_token_ids):
            continue
        out.append(e.model_copy(update={"prompt_token_ids": e.prompt_token_ids[base:]}))
    return tuple(out)
