"""The ledger's exception tree.  Every refusal raises one of these.

    LedgerError
    ├── InvalidInput (also a ValueError)          bad ids, records, arrays      → 422 / 400
    │   ├── InvalidRolloutId
    │   ├── InvalidRecord
    │   └── UnsupportedSchemaVersion
    ├── NotFound                                  unknown rollout / call         → 404
    ├── AccessDenied                              missing or wrong API token     → 401 / 403
    ├── StateConflict                             the ledger's state forbids it  → 409 / 410
    │   ├── PayloadConflict                       same call id, different bytes  → 409
    │   ├── RolloutFrozen                         write after freeze             → 409
    │   └── RolloutRetired                        anything after retire          → 410
    └── Unavailable                               the database cannot be reached → 503
        └── NoLedger                              no ledger schema at that URL   → 503

Driver errors are translated into this tree once, in ``ledger.storage.translate``; routes map
the tree to HTTP status codes once, in ``api.errors``.
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "InvalidInput",
    "InvalidRecord",
    "InvalidRolloutId",
    "LedgerError",
    "NoLedger",
    "NotFound",
    "PayloadConflict",
    "RolloutFrozen",
    "RolloutRetired",
    "StateConflict",
    "Unavailable",
    "UnsupportedSchemaVersion",
]


class LedgerError(Exception):
    """Base of every error the ledger raises on purpose."""

    code = "ledger_error"

    def __init__(self, message: str, *, rollout_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.rollout_id = rollout_id


class InvalidInput(LedgerError, ValueError):
    """The input is malformed; nothing was changed."""

    code = "invalid_input"


class InvalidRolloutId(InvalidInput):
    code = "invalid_rollout_id"


class InvalidRecord(InvalidInput):
    code = "invalid_record"


class UnsupportedSchemaVersion(InvalidInput):
    code = "unsupported_schema_version"


class NotFound(LedgerError):
    code = "not_found"


class AccessDenied(LedgerError):
    """The ledger service refused the API token (remote transports only)."""

    code = "access_denied"


class StateConflict(LedgerError):
    """The rollout's state forbids the operation."""

    code = "state_conflict"


class PayloadConflict(StateConflict):
    """The call id was already recorded with different bytes; the first record stays."""

    code = "payload_conflict"


class RolloutFrozen(StateConflict):
    code = "rollout_frozen"


class RolloutRetired(StateConflict):
    code = "rollout_retired"


class Unavailable(LedgerError):
    """The database could not be reached or did not answer in time."""

    code = "unavailable"


class NoLedger(Unavailable):
    """The URL holds no ledger (or one at another schema revision); nothing was created.

    Only ``rollout-ledger db upgrade`` and ``serve`` create or migrate a ledger.
    """

    code = "no_ledger"
