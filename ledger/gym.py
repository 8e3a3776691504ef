"""NeMo Gym-compatible capture classes, constructible by import path with keyword arguments.

A Gym or NeMo RL config names them as ``ledger.gym:CaptureSink`` (``token_id_capture.sink``),
``ledger.gym:CaptureLineageStore`` (``lineage_store``) and, on the trainer side,
``ledger.gym:CaptureSource``, each with ``url=`` a SQLAlchemy database URL
(``sqlite+aiosqlite:///PATH``, ``postgresql+asyncpg://…``) or the ``http(s)://`` URL of a
``rollout-ledger serve`` (plus ``token=``).  Separately constructed clients see each other's
committed writes at once: every write is committed before its call returns.

They satisfy the protocols of the released nemo-gym 0.7.0 (``TokenSink``, ``TokenSource``,
``LineageResolver``, ``CaptureLedger``; ``docs/gym-compatibility.md`` goes through every point):

- ``CaptureSink.put`` takes the release's ``TokenEntry`` (or a dict, or the ledger's own), keeps
  every field Gym's builder reads, and follows the release's "same payload" rule: the identical
  serialised entry is a no-op, the same call id with other bytes is refused (``PayloadConflict``)
  and marks the rollout incomplete;
- ``CaptureSource.freeze`` returns the entries as they were put (a Gym delta record keeps its
  suffix prompt), so the release's builder reads them;
- ``CaptureLineageStore.resolve(rollout_id, request_items)`` answers 0.7.0's ``LineageResolution``
  (``ledger.gym_lineage``); ``resolve_prompt(rollout_id, prompt_token_ids)`` is the ledger's own
  token-prefix lookup (what the ``/lineage/resolve`` route serves);
- ``CaptureLineageStore`` is also 0.7.0's ``CaptureLedger`` for external staging (``record``,
  ``record_failure``, ``manifest``, ``has_rows``: token-free custody rows, ``ledger.custody``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ledger.gym_lineage import LineageResolution, gym_view, in_gym_terms
from ledger.storage.ledger import Ledger
from ledger.storage.results import FrozenSnapshot, PutResult
from ledger.storage.results import LineageResolution as PromptResolution

__all__ = ["CaptureLineageStore", "CaptureSink", "CaptureSource", "LedgerBackend", "open_backend"]


class LedgerBackend(Protocol):
    """What the Gym classes need from a ledger: the local ``Ledger`` or the HTTP client."""

    async def begin_call(
        self, rollout_id: str, model_call_id: str, *, route: str | None = None, model: str = ""
    ) -> bool: ...
    async def cancel_call(self, rollout_id: str, model_call_id: str) -> bool: ...
    async def put(self, entry: Any) -> PutResult: ...
    async def mark_delivery(
        self, delivery_id: int, *, handed_off: bool = False, durable: bool = False
    ) -> None: ...
    async def delete_rollout(self, rollout_id: str) -> bool: ...
    async def mark_incomplete(
        self, rollout_id: str, model_call_id: str = "", *, reason: str, detail: str = ""
    ) -> int: ...
    async def freeze(self, rollout_id: str) -> FrozenSnapshot: ...
    async def retire(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool: ...
    async def resolve(self, rollout_id: str, prompt_token_ids: list[int]) -> PromptResolution: ...
    async def close(self) -> None: ...


def open_backend(
    url: str, *, token: str | None = None, delta_records: bool = True, **kwargs: Any
) -> LedgerBackend:
    """A database URL gives direct SQL access; an ``http(s)://`` URL a remote ledger service."""
    if url.startswith(("http://", "https://")):
        from ledger.client import RemoteLedger

        return RemoteLedger(url, token=token, **kwargs)
    # Never creates or migrates a ledger: `db upgrade` or `serve` does (NoLedger otherwise).
    return Ledger(url, delta_records=delta_records, check_schema=True)


class _Client:
    def __init__(
        self, url: str, *, token: str | None = None, delta_records: bool = True, **kwargs: Any
    ) -> None:
        self.url = url
        self._backend = open_backend(url, token=token, delta_records=delta_records, **kwargs)
        self._closed = False

    @property
    def backend(self) -> LedgerBackend:
        return self._backend

    async def close(self) -> None:
        """Idempotent: nothing is buffered, every write was committed when it returned."""
        if not self._closed:
            self._closed = True
            await self._backend.close()


class CaptureSink(_Client):
    """Gym ``TokenSink`` (with the ``begin_call`` extension, and the ledger's ``cancel_call``)."""

    async def put(self, entry: Any) -> None:
        """Store one record durably (and visible to every resolver) before returning.

        ``entry``: the release's ``TokenEntry``, a dict, or ``ledger.TokenEntry``.  See
        ``Ledger.put`` for the promises.
        """
        await self._backend.put(entry)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        await self._backend.begin_call(rollout_id, model_call_id)

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> None:
        await self._backend.cancel_call(rollout_id, model_call_id)

    async def mark_incomplete(
        self,
        rollout_id: str,
        model_call_id: str = "",
        reason: str = "capture_failed",
        detail: str = "",
    ) -> None:
        await self._backend.mark_incomplete(rollout_id, model_call_id, reason=reason, detail=detail)


class CaptureSource(_Client):
    """Gym ``TokenSource``: freeze a rollout, then retire exactly the consumed snapshot."""

    async def freeze(self, rollout_id: str) -> FrozenSnapshot:
        """Freeze (idempotent) and return the entries as they were put, from one read."""
        snap = await self._backend.freeze(rollout_id)
        return FrozenSnapshot(
            snap.rollout_id, gym_view(snap.entries), snap.incomplete, snap.snapshot_id, snap.version
        )

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await self._backend.retire(rollout_id, snapshot_id=snapshot_id, version=version)


class CaptureLineageStore(_Client):
    """Gym ``LineageResolver`` over every committed record (shared by every worker), and Gym's
    ``CaptureLedger`` for external staging (``record``, ``record_failure``, ``manifest``,
    ``has_rows``)."""

    async def resolve(self, rollout_id: str, request_items: Sequence[Any]) -> LineageResolution:
        """0.7.0's parent decision for a request's unmodified items (``ledger.gym_lineage``)."""
        remote = getattr(self._backend, "resolve_request", None)
        if remote is not None:
            resolution: LineageResolution = await remote(rollout_id, list(request_items))
        else:
            from ledger.gym_store import resolve_request

            resolution = await resolve_request(self._local(), rollout_id, list(request_items))
        return in_gym_terms(resolution)

    async def resolve_prompt(
        self, rollout_id: str, prompt_token_ids: Sequence[int]
    ) -> PromptResolution:
        """The ledger's token-prefix lookup: the proven parent of a prompt and its tokens."""
        return await self._backend.resolve(rollout_id, list(prompt_token_ids))

    def is_process_shared(self) -> bool:
        """Every worker reads the same database: a committed put is visible to all at once."""
        return True

    # -- 0.7.0 ``CaptureLedger`` (external staging: token-free custody rows, ``ledger.custody``)

    async def record(self, commit: Any) -> None:
        """Publish a staged call (``CaptureLedgerCommit``); write-once per call id."""
        remote = getattr(self._backend, "custody_record", None)
        if remote is not None:
            await remote(commit)
            return
        from ledger import custody

        await custody.record(self._local(), commit)

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Record a call whose capture did not complete (a poison row, never a parent)."""
        remote = getattr(self._backend, "custody_record_failure", None)
        if remote is not None:
            await remote(rollout_id, model_call_id, reason)
            return
        from ledger import custody

        await custody.record_failure(self._local(), rollout_id, model_call_id, reason)

    async def manifest(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's ``RolloutManifest`` payload: committed records and failures, no tokens."""
        remote = getattr(self._backend, "custody_manifest", None)
        if remote is not None:
            data: dict[str, Any] = await remote(rollout_id)
            return data
        from ledger import custody

        return await custody.manifest(self._local(), rollout_id)

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether any custody row (committed or failed) exists for the rollout."""
        remote = getattr(self._backend, "custody_has_rows", None)
        if remote is not None:
            return bool(await remote(rollout_id))
        from ledger import custody

        return await custody.has_rows(self._local(), rollout_id)

    def _local(self) -> Ledger:
        assert isinstance(self._backend, Ledger)
        return self._backend
