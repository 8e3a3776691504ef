"""rollout-ledger: exact training tokens from agent harnesses, in a SQL ledger.

The public surface is ``__all__``; everything else is private by module name.  Only the error
tree is imported with the package: every other name is loaded on first use, so ``import ledger``
(or ``from ledger import TokenEntry`` in a Gym model server) does not pull in SQLAlchemy,
the drivers or HTTP clients it does not need.

- records: ``TokenEntry`` (NeMo Gym 0.7.0's schema-1 record), ``ParentResolutionStatus``;
- Gym classes (``token_id_capture.sink: ledger.gym:CaptureSink`` …): ``CaptureSink``,
  ``CaptureSource``, ``CaptureLineageStore``; 0.7.0's lineage answer ``LineageResolution`` /
  ``LineageMatch`` and ``stamp_continuation``;
- the trainer side: ``finalize_rollout_token_capture``, ``retire_rollout_token_capture`` (Gym's
  dict answers), the typed ``Build`` they convert from, and the ``TokenSource`` protocol any
  source of frozen entries meets;
- the ledger itself: ``Ledger`` (SQL), ``RemoteLedger`` (HTTP);
- ``run_conformance`` / ``ConformanceError``;
- the error tree, rooted at ``LedgerError`` (``ledger.errors`` draws it).
"""

import importlib as _importlib
import typing as _typing

from ledger.errors import (
    AccessDenied,
    BuildError,
    BuildInputError,
    CaptureFailed,
    ConformanceError,
    InvalidInput,
    InvalidRecord,
    InvalidRolloutId,
    LedgerError,
    NoLedger,
    NotFound,
    PayloadConflict,
    ProjectionError,
    RequestRefused,
    RolloutFrozen,
    RolloutRetired,
    StaleSnapshot,
    StateConflict,
    Unavailable,
    UnsupportedSchemaVersion,
)

if _typing.TYPE_CHECKING:
    from ledger.client import RemoteLedger
    from ledger.conformance import run_conformance
    from ledger.delivery import finalize_rollout_token_capture, retire_rollout_token_capture
    from ledger.gym import CaptureLineageStore, CaptureSink, CaptureSource
    from ledger.gym_lineage import LineageMatch, LineageResolution, stamp_continuation
    from ledger.records import ParentResolutionStatus, TokenEntry
    from ledger.store import Ledger
    from ledger.types import Build, TokenSource

__all__ = [
    "AccessDenied",
    "Build",
    "BuildError",
    "BuildInputError",
    "CaptureFailed",
    "CaptureLineageStore",
    "CaptureSink",
    "CaptureSource",
    "ConformanceError",
    "InvalidInput",
    "InvalidRecord",
    "InvalidRolloutId",
    "Ledger",
    "LedgerError",
    "LineageMatch",
    "LineageResolution",
    "NoLedger",
    "NotFound",
    "ParentResolutionStatus",
    "PayloadConflict",
    "ProjectionError",
    "RemoteLedger",
    "RequestRefused",
    "RolloutFrozen",
    "RolloutRetired",
    "StaleSnapshot",
    "StateConflict",
    "TokenEntry",
    "TokenSource",
    "Unavailable",
    "UnsupportedSchemaVersion",
    "finalize_rollout_token_capture",
    "retire_rollout_token_capture",
    "run_conformance",
    "stamp_continuation",
]

_LAZY = {
    "Build": "ledger.types",
    "CaptureLineageStore": "ledger.gym",
    "CaptureSink": "ledger.gym",
    "CaptureSource": "ledger.gym",
    "Ledger": "ledger.store",
    "LineageMatch": "ledger.gym_lineage",
    "LineageResolution": "ledger.gym_lineage",
    "ParentResolutionStatus": "ledger.records",
    "RemoteLedger": "ledger.client",
    "TokenEntry": "ledger.records",
    "TokenSource": "ledger.types",
    "finalize_rollout_token_capture": "ledger.delivery",
    "retire_rollout_token_capture": "ledger.delivery",
    "run_conformance": "ledger.conformance",
    "stamp_continuation": "ledger.gym_lineage",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ledger' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
