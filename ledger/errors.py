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
    │   ├── RolloutRetired                        anything after retire          → 410
    │   └── StaleSnapshot                         retire at another snapshot     → 409
    ├── Unavailable                               the database cannot be reached → 503
    │   └── NoLedger                              no ledger schema at that URL   → 503
    ├── BuildError (also a ValueError)            a snapshot that cannot be built: the build
    │   │                                         is masked (``build_failed``), never raised
    │   ├── BuildInputError                       contradictory call metadata (ledger.builder)
    │   └── ProjectionError                       no contiguous chain (ledger.projection)
    ├── ConformanceError (also an AssertionError) a conformance check failed (ledger.conformance)
    ├── RequestRefused (also a ValueError)        a harness request the capture proxy cannot
    │                                             send upstream → 400 in the harness's dialect
    │                                             (api.dialects: DialectError, InvalidRequest,
    │                                             UnsupportedRequest)
    └── CaptureFailed                             an answer whose tokens cannot be read: the
                                                  rollout is marked incomplete with ``reason``,
                                                  the call is still answered (api.extract:
                                                  TokenExtractionError, MissingTokenIds,
                                                  MalformedTokenPayload)

Classes defined elsewhere keep their home module's name as an alias (``ledger.builder``,
``ledger.projection``, ``ledger.conformance`` re-export theirs from here).  Errors that are not
refusals of the ledger stay outside the tree on purpose: configuration and command-line errors
(``ConfigError``, ``CliError``, ``CollectAborted``/``CollectRefused``), body-size and JSON
parsing limits of the web layer, the proxy's upstream failures (``api.upstream.UpstreamFailure``,
answered in the harness's dialect, never raised past the proxy), and private control-flow
exceptions.

Driver errors are translated into this tree once, in ``ledger.storage.translate``; routes map
the tree to HTTP status codes once, in ``api.errors`` (a branch without a status there, such as
``BuildError``, is a 500 if it ever escapes).
"""

from __future__ import annotations

__all__ = [
    "AccessDenied",
    "BuildError",
    "BuildInputError",
    "CaptureFailed",
    "ConformanceError",
    "InvalidInput",
    "InvalidRecord",
    "InvalidRolloutId",
    "LedgerError",
    "NoLedger",
    "NotFound",
    "PayloadConflict",
    "ProjectionError",
    "RequestRefused",
    "RolloutFrozen",
    "RolloutRetired",
    "StaleSnapshot",
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


class StaleSnapshot(StateConflict):
    """Retire named a snapshot identity the rollout is not frozen at: nothing was retired."""

    code = "stale_snapshot"


class Unavailable(LedgerError):
    """The database could not be reached or did not answer in time."""

    code = "unavailable"


class NoLedger(Unavailable):
    """The URL holds no ledger (or one at another schema revision); nothing was created.

    Only ``rollout-ledger db upgrade`` and ``serve`` create or migrate a ledger.
    """

    code = "no_ledger"


class BuildError(LedgerError, ValueError):
    """A frozen snapshot cannot be built into a trainable rollout; the build is masked."""

    code = "build_failed"


class BuildInputError(BuildError):
    """The snapshot's call metadata contradicts itself (duplicate call ids, lengths that do not
    add up, a verified parent longer than its child's prompt).  Nothing can be proven; the
    caller records a ``build_failed`` plan (see :func:`ledger.builder.failed_plan`)."""

    code = "build_input"


class ProjectionError(BuildError):
    """The chain cannot be projected, or a projected response is not prefix-contiguous."""

    code = "projection_failed"


class ConformanceError(LedgerError, AssertionError):
    """A conformance check failed; ``check`` names it."""

    code = "conformance_failed"

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check
        self.check_name = check
        self.detail = detail


class RequestRefused(LedgerError, ValueError):
    """A harness request the capture proxy cannot send upstream; nothing was dispatched.

    The proxy's translation layer raises its subclasses (``api.dialects.DialectError``)."""

    code = "request_refused"


class CaptureFailed(LedgerError):
    """The tokens of an upstream answer cannot be read; ``reason`` is the incomplete-event
    reason.  The proxy's extraction raises its subclasses (``api.extract``)."""

    code = "capture_failed"
