"""Compatibility facade: the ledger API now lives in ``api.routes`` (one module per route
family) with its bodies and answers in ``api.schemas``.  Kept so existing imports work."""

from __future__ import annotations

from api.errors import COMMON_ERRORS
from api.routes import router
from api.routes.common import CallId, LedgerDep, RolloutId, ledger_of
from api.schemas import ID_PATTERN, REASON_PATTERN
from ledger.errors import StaleSnapshot

__all__ = [
    "COMMON_ERRORS",
    "ID_PATTERN",
    "REASON_PATTERN",
    "CallId",
    "LedgerDep",
    "RolloutId",
    "StaleSnapshot",
    "ledger_of",
    "router",
]
