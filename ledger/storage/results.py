"""The ledger's result types: plain frozen dataclasses, importable without SQLAlchemy
(``ledger.client`` and ``ledger.gym`` need them, not the storage engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ledger.model import CallView
from ledger.records import TokenEntry

__all__ = [
    "ContinuationCandidate",
    "FrozenSnapshot",
    "LineageResolution",
    "PutResult",
    "RetireOutcome",
    "RolloutState",
    "SnapshotViews",
]


@dataclass(frozen=True, slots=True)
class RolloutState:
    rollout_id: str
    state: str
    incomplete: bool
    snapshot_id: str | None
    version: int


@dataclass(frozen=True, slots=True)
class PutResult:
    """``status`` is ``created`` or ``duplicate`` (a byte-identical repeat: nothing changed)."""

    status: str
    version: int
    parent_call_id: str | None = None
    prompt_is_delta: bool = False
    edge_method: str | None = None
    # ``put(settle_retry_key=...)``: the failed attempts its transaction cancelled (None: not
    # asked, or the record was refused).
    settled: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class LineageResolution:
    """The lineage store's answer for a candidate prompt (seed: lineage store).

    ``status``: ``root`` (no captured call's tokens prefix the prompt), ``resolved`` (the proven
    parent and its exact cumulative tokens), ``unresolved`` (the ledger cannot decide; ``reason``).
    """

    status: str
    model_call_id: str | None = None
    cumulative_token_ids: list[int] | None = None
    digest: str | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ContinuationCandidate:
    """A captured call a request continues by conversation (see ``continuation_candidates``)."""

    model_call_id: str
    cumulative_len: int
    cumulative_digest: str
    generation_len: int
    extra: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FrozenSnapshot:
    """NeMo Gym's ``TokenCaptureSnapshot``: full-prompt entries from one consistent read."""

    rollout_id: str
    entries: tuple[TokenEntry, ...]
    incomplete: bool
    snapshot_id: str
    version: int


@dataclass(frozen=True, slots=True)
class SnapshotViews:
    """A frozen snapshot for the builder: call metadata and edges, no token arrays."""

    rollout_id: str
    calls: tuple[CallView, ...]
    n_calls: int
    incomplete: bool
    snapshot_id: str
    version: int
    incomplete_reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RetireOutcome:
    """What one retire found and did, decided in its own transaction (the one retire rule).

    ``status``: ``retired`` (this call retired the snapshot), ``repeat`` (already retired at
    exactly this identity: a safe repeat after a lost answer), ``retired_elsewhere`` (retired at
    another identity), ``stale`` (open, or frozen at another identity: nothing retired),
    ``unknown`` (no such rollout).  ``state`` is the rollout as the decision saw it.
    """

    status: Literal["retired", "repeat", "retired_elsewhere", "stale", "unknown"]
    state: RolloutState | None

    @property
    def retired(self) -> bool:
        """True when the snapshot is retired at exactly the asked identity (now or before)."""
        return self.status in ("retired", "repeat")
