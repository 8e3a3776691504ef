"""Build a rollout from any NeMo Gym ``TokenSource`` with the ledger's own builder.

``finalize_rollout_token_capture(result, source)`` takes the ledger's fast path when ``source``
is the ledger (``CaptureSource``, ``Ledger``, ``RemoteLedger``).  Any other ``TokenSource``
(Gym 0.7.0's file store ``TokenCaptureStore``, a training framework's transport) only promises
``freeze`` and ``drop``; for those, ``build_from_source``:

1. freezes the rollout once (that snapshot's ``snapshot_id``/``version`` are what
   ``retire_rollout_token_capture`` later hands to ``source.drop``);
2. ingests its entries into a private, throw-away SQLite ledger, parents before children (Gym
   delta records after the parent they extend), so every record goes through the same ingest as
   a live capture: the same validation, the same token-prefix proof, the same delta
   reconstruction;
3. marks that ledger incomplete when the snapshot is incomplete or an entry is refused (with the
   refusal as the detail);
4. runs the same build (``build``: ``ledger.delivery.build_rollout``, handed in by the caller
   so this module never imports the delivery module that imports it) and returns it with the
   source's snapshot identity.

Nothing of the scratch ledger survives the call.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, Protocol

import sqlalchemy as sa

from ledger.errors import LedgerError
from ledger.records import TokenEntry, coerce_entry
from ledger.store import Ledger
from ledger.types import Build, TokenSource

__all__ = ["build_from_source", "ingest_order"]


class Builder(Protocol):
    """``ledger.delivery.build_rollout``'s signature (handed in: no import cycle)."""

    def __call__(
        self, ledger: Ledger, result: dict[str, Any], *, deliver: str = ..., consumer: str = ...
    ) -> Awaitable[Build]: ...


async def build_from_source(
    source: TokenSource,
    result: dict[str, Any],
    rollout_id: str,
    build: Builder,
    *,
    deliver: str = "one",
    consumer: str = "",
) -> Build:
    """Freeze ``rollout_id`` at ``source`` and build it with the ledger's builder (``build``);
    the build carries the source's snapshot identity and no delivery row."""
    snapshot = await source.freeze(rollout_id)
    with tempfile.TemporaryDirectory(prefix="rollout-ledger-build-") as tmp:
        scratch = await asyncio.to_thread(_scratch_ledger, Path(tmp))
        try:
            await _ingest(scratch, rollout_id, snapshot.entries, bool(snapshot.incomplete))
            built = await build(scratch, result, deliver=deliver, consumer=consumer)
        finally:
            await scratch.close()
    return built.at_snapshot(str(snapshot.snapshot_id), int(snapshot.version))


_EMPTY_SCHEMA: bytes | None = None


def _scratch_ledger(directory: Path) -> Ledger:
    from ledger.engine import make_sync_engine
    from ledger.tables import Base

    global _EMPTY_SCHEMA
    path = directory / "build.db"
    url = f"sqlite+aiosqlite:///{path}"
    if _EMPTY_SCHEMA is None:
        engine = make_sync_engine(url)
        try:
            Base.metadata.create_all(engine)
        finally:
            engine.dispose()  # the last connection checkpoints the WAL into the file
        _EMPTY_SCHEMA = path.read_bytes()
    else:
        path.write_bytes(_EMPTY_SCHEMA)  # a copy of the empty schema: no DDL per rollout
    ledger = Ledger(url, group_commit=False)
    # A scratch file nobody recovers after a crash: durable commits would only cost fsyncs.
    sa.event.listen(ledger.engine.sync_engine, "connect", _no_fsync)
    return ledger


def _no_fsync(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA synchronous=OFF")
    cur.close()


async def _ingest(
    ledger: Ledger, rollout_id: str, entries: Sequence[Any], incomplete: bool
) -> None:
    refused: list[str] = []
    parsed: list[TokenEntry] = []
    for raw in entries:
        try:
            entry = coerce_entry(raw)
        except LedgerError as exc:
            refused.append(f"{getattr(raw, 'model_call_id', '?')}: {exc}")
            continue
        if entry.rollout_id != rollout_id:
            refused.append(f"{entry.model_call_id}: belongs to rollout {entry.rollout_id!r}")
            continue
        parsed.append(entry)
    for entry in ingest_order(parsed):
        try:
            await ledger.put(entry)
        except LedgerError as exc:
            refused.append(f"{entry.model_call_id}: {exc}")
    if incomplete:
        await ledger.mark_incomplete(
            rollout_id, reason="source_incomplete", detail="the source's snapshot is incomplete"
        )
    if refused:
        await ledger.mark_incomplete(
            rollout_id, reason="capture_failed", detail="; ".join(refused)[:4000]
        )


def ingest_order(entries: Sequence[TokenEntry]) -> list[TokenEntry]:
    """Entries ordered so every possible parent is ingested before its children.

    By full prompt length (a parent's prompt + generation is at most its child's prompt), then
    by depth in the delta chain (a delta record after the record it extends, even when that one
    generated nothing), then call id.
    """
    by_id = {e.model_call_id: e for e in entries}
    depth: dict[str, int] = {}

    def delta_depth(e: TokenEntry) -> int:
        seen: list[str] = []
        cur: TokenEntry | None = e
        while cur is not None and cur.prompt_is_delta and cur.model_call_id not in depth:
            if cur.model_call_id in seen:  # a cycle: nothing in it can be reconstructed
                break
            seen.append(cur.model_call_id)
            cur = by_id.get(cur.parent_call_id or "")
        base = depth.get(cur.model_call_id, 0) if cur is not None else 0
        for n, call_id in enumerate(reversed(seen), start=1):
            depth[call_id] = base + n
        return depth.get(e.model_call_id, 0)

    def full_prompt_len(e: TokenEntry) -> int:
        if e.prompt_is_delta and e.cum_len is not None:
            return e.cum_len - len(e.generation_token_ids)
        return len(e.prompt_token_ids)

    return sorted(entries, key=lambda e: (full_prompt_len(e), delta_depth(e), e.model_call_id))
