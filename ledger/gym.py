"""NeMo Gym-compatible capture classes, constructible by import path with keyword arguments.

A Gym or NeMo RL config names them as ``ledger.gym:CaptureSink`` (``token_id_capture.sink``),
``ledger.gym:CaptureLineageStore`` (``lineage_store``) and, on the trainer side,
``ledger.gym:CaptureSource``, each with ``url=`` a SQLAlchemy database URL
(``sqlite+aiosqlite:///PATH``, ``postgresql+asyncpg://…``) or the ``http(s)://`` URL of a
``rollout-ledger serve`` (plus ``token=``).  Separately constructed clients see each other's
committed writes at once: every write is committed before its call returns.
"""

from __future__ import annotations

from typing import Any, Protocol

from ledger.records import TokenEntry
from ledger.store import FrozenSnapshot, Ledger, LineageResolution, PutResult

__all__ = ["CaptureLineageStore", "CaptureSink", "CaptureSource", "LedgerBackend", "open_backend"]


class LedgerBackend(Protocol):
    """What the Gym classes need from a ledger: the local ``Ledger`` or the HTTP client."""

    async def begin_call(
        self, rollout_id: str, model_call_id: str, *, route: str | None = None, model: str = ""
    ) -> bool: ...
    async def cancel_call(self, rollout_id: str, model_call_id: str) -> bool: ...
    async def put(self, entry: TokenEntry | dict[str, Any]) -> PutResult: ...
    async def finalize(
        self, result: dict[str, Any], *, deliver: str = "one", consumer: str = ""
    ) -> dict[str, Any]: ...
    async def mark_delivery(
        self, delivery_id: int, *, handed_off: bool = False, durable: bool = False
    ) -> None: ...
    async def delete_rollout(self, rollout_id: str) -> bool: ...
    async def mark_incomplete(
        self, rollout_id: str, model_call_id: str = "", *, reason: str, detail: str = ""
    ) -> int: ...
    async def freeze(self, rollout_id: str) -> FrozenSnapshot: ...
    async def retire(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool: ...
    async def resolve(self, rollout_id: str, prompt_token_ids: list[int]) -> LineageResolution: ...
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
    """Gym ``TokenSink`` (with the ``begin_call``/``cancel_call`` extension)."""

    async def put(self, entry: TokenEntry | dict[str, Any]) -> None:
        """Store one record durably before returning; see ``Ledger.put`` for the promises."""
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
        return await self._backend.freeze(rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        return await self._backend.retire(rollout_id, snapshot_id=snapshot_id, version=version)


class CaptureLineageStore(_Client):
    """Gym lineage store: the proven parent of a prompt, over every committed record."""

    async def resolve(self, rollout_id: str, prompt_token_ids: list[int]) -> LineageResolution:
        return await self._backend.resolve(rollout_id, list(prompt_token_ids))

    def is_process_shared(self) -> bool:
        return True
