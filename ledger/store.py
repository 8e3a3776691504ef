"""The ledger's storage surface under its historical name: a facade over ``ledger.storage``.

``from ledger.store import Ledger`` (and ``Audit`` and the result types) keeps working; the code
lives in the rooms of ``ledger/storage/`` (see docs/architecture.md).
"""

from __future__ import annotations

from ledger.storage.audit import Audit, RolloutSummary
from ledger.storage.core import _prepare, _Prepared
from ledger.storage.ledger import Ledger
from ledger.storage.results import (
    ContinuationCandidate,
    FrozenSnapshot,
    LineageResolution,
    PutResult,
    RolloutState,
    SnapshotViews,
)

__all__ = [
    "Audit",
    "ContinuationCandidate",
    "FrozenSnapshot",
    "Ledger",
    "LineageResolution",
    "PutResult",
    "RolloutState",
    "RolloutSummary",
    "SnapshotViews",
    "_Prepared",
    "_prepare",
]
