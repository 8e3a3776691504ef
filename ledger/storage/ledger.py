"""The ledger: one class joining the storage rooms over one database.

Each room is a mixin over ``LedgerCore`` (connections, transactions, the rollout lock):
``capture`` (intents, records, incomplete marks), ``lineage`` (proven parents, chain reads),
``snapshot`` (freeze and its reads), ``lifecycle`` (retire, admin, deliveries).  Every public
method's docstring, in its room, states the promise it keeps (design §4).
"""

from __future__ import annotations

from ledger.storage.capture import CaptureOps
from ledger.storage.lifecycle import LifecycleOps
from ledger.storage.snapshot import SnapshotOps

__all__ = ["Ledger"]


class Ledger(CaptureOps, SnapshotOps, LifecycleOps):
    """The SQL ledger over one database (a SQLite file or a Postgres database)."""
