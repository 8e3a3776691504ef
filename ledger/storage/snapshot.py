"""Freeze and the snapshot reads: full-prompt entries, builder views, the delivered chain."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from ledger import codec, jsonio
from ledger.builder import RECORDED_PARENT_METHOD
from ledger.errors import (
    InvalidRecord,
    RolloutRetired,
)
from ledger.ids import validate_rollout_id
from ledger.lineage_ingest import decision_of_stored
from ledger.model import CallView, ChainLinkTokens
from ledger.records import TokenEntry
from ledger.storage import queries
from ledger.storage.core import _failed_attempt
from ledger.storage.lineage import LineageOps
from ledger.storage.results import (
    FrozenSnapshot,
    RolloutState,
    SnapshotViews,
)
from ledger.tables import (
    utcnow,
)


class SnapshotOps(LineageOps):
    """Freeze and snapshot reads (a mixin of ``Ledger``)."""

    def _freeze_in(self, conn: Connection, rollout_id: str) -> RolloutState:
        state = self._lock_rollout(conn, rollout_id)
        if state.state == "retired":
            raise RolloutRetired(
                f"token capture for rollout {rollout_id} is retired; freeze refused",
                rollout_id=rollout_id,
            )
        if state.state == "frozen":
            return state
        dangling = (conn.execute(queries.open_intents(rollout_id))).all()
        for cid, extra in dangling:
            failed = _failed_attempt(extra)
            conn.execute(
                queries.add_incomplete_event(
                    rollout_id,
                    cid,
                    failed.get("reason") or "dangling_intent",
                    (
                        f"{failed.get('detail', '')}; no retry of it succeeded before freeze"
                        if failed
                        else "call was registered before dispatch but has no record at freeze"
                    ),
                )
            )
        snapshot_id = uuid.uuid4().hex
        version = self._bump(
            conn,
            rollout_id,
            state="frozen",
            snapshot_id=snapshot_id,
            frozen_at=utcnow(),
            incomplete=state.incomplete or bool(dangling),
        )
        return RolloutState(
            rollout_id, "frozen", state.incomplete or bool(dangling), snapshot_id, version
        )

    async def freeze_state(self, rollout_id: str) -> RolloutState:
        """Freeze (idempotent) and return only the snapshot identity."""
        validate_rollout_id(rollout_id)

        def body(conn: Connection) -> RolloutState:
            return self._freeze_in(conn, rollout_id)

        return await self._transact(body)

    async def freeze(self, rollout_id: str) -> FrozenSnapshot:
        """Freeze and return full-prompt entries, incomplete flag, snapshot id and version from
        one consistent read (§4.4).  Unknown rollouts freeze empty (and stay frozen)."""
        validate_rollout_id(rollout_id)

        def body(conn: Connection) -> FrozenSnapshot:
            state = self._freeze_in(conn, rollout_id)
            rows = (conn.execute(queries.captured_calls_with_tokens(rollout_id))).all()
            entries, broken = _entries_from_rows(rows)
            state = self._record_broken(conn, state, broken)
            return FrozenSnapshot(
                rollout_id,
                tuple(entries),
                state.incomplete,
                state.snapshot_id or "",
                state.version,
            )

        return await self._transact(body)

    def _record_broken(
        self, conn: Connection, state: RolloutState, broken: Sequence[tuple[str, str]]
    ) -> RolloutState:
        """Mark unreconstructable delta chains incomplete once (a later freeze finds them noted)."""
        if not broken:
            return state
        known = set(
            (
                conn.execute(
                    queries.calls_noted_incomplete(
                        state.rollout_id, "delta_chain_unreconstructable"
                    )
                )
            ).scalars()
        )
        version = state.version
        for cid, detail in broken:
            if cid not in known:
                version = self._add_incomplete(
                    conn, state.rollout_id, cid, "delta_chain_unreconstructable", detail
                )
        return RolloutState(state.rollout_id, state.state, True, state.snapshot_id, version)

    async def freeze_views(self, rollout_id: str) -> SnapshotViews:
        """Freeze and return call metadata and proven edges (no token arrays) in one read.

        One transaction (the atomic snapshot): the lock, then two reads, the calls and, in
        one statement, the edges and the distinct incomplete reasons."""
        validate_rollout_id(rollout_id)

        def body(conn: Connection) -> SnapshotViews:
            state = self._freeze_in(conn, rollout_id)
            calls = conn.execute(queries.CAPTURED_CALLS, {"rollout_id": rollout_id}).all()
            edges: list[Any] = []
            reasons: list[str] = []
            for row in conn.execute(queries.EDGES_AND_REASONS, {"rollout_id": rollout_id}):
                if row.kind == 0:
                    edges.append(row)
                else:
                    reasons.append(row.reason)
            return SnapshotViews(
                rollout_id,
                tuple(_views(calls, edges)),
                len(calls),
                state.incomplete,
                state.snapshot_id or "",
                state.version,
                tuple(sorted(reasons)),
            )

        return await self._transact(body)

    async def load_chain(
        self, rollout_id: str, terminal_call_id: str, *, expect: Sequence[str] | None = None
    ) -> list[ChainLinkTokens]:
        """The tokens of ``terminal_call_id``'s ancestor chain, root first, each read once.

        Walks verified parents in one recursive query (one round trip, compiled once); every
        link's cumulative digest is re-checked while the chain is replayed, in one pass over
        the chain's tokens.  ``expect`` (the builder's plan) must match.
        """
        rows = await self._read_one(
            queries.CHAIN, {"rollout_id": rollout_id, "call_id": terminal_call_id}
        )
        if not rows:
            raise InvalidRecord(f"call {terminal_call_id!r} has no captured record")
        ids = [r.model_call_id for r in rows]
        if expect is not None and list(expect) != ids:
            raise InvalidRecord(f"stored chain {ids} differs from the planned chain {list(expect)}")
        return _replay_chain(rows)

    async def _read_one(self, query: Any, params: dict[str, Any]) -> list[Any]:
        """The rows of one read statement.  Postgres: in autocommit (one statement is one
        consistent snapshot by itself; no BEGIN and COMMIT round trips around it)."""
        if not self.sql.lone_statements_in_autocommit:
            async with self._read() as conn:
                return list((await conn.execute(query, params)).all())
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        async with self._translate(), self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            return list((await conn.execute(query, params)).all())


def _views(calls: Sequence[Any], edges: Sequence[Any]) -> list[CallView]:
    by_pk = {c.id: c for c in calls}
    edge_of: dict[int, Any] = {}
    for e in edges:
        # A verified edge outranks a drifted one for the same child.
        cur = edge_of.get(e.child_id)
        if cur is None or (cur.status != "verified" and e.status == "verified"):
            edge_of[e.child_id] = e
    views = []
    for c in calls:
        e = edge_of.get(c.id)
        parent = by_pk.get(e.parent_id) if e is not None else None
        extra = _json_of(c.extra)
        boundary = _recorded_boundary(extra) if e is None else None
        views.append(
            CallView(
                model_call_id=c.model_call_id,
                prompt_len=c.prompt_len,
                generation_len=c.generation_len,
                cumulative_len=c.cumulative_len,
                cumulative_digest=c.cumulative_digest,
                prompt_digest=c.prompt_digest,
                created_at=c.created_at or 0.0,
                parent_call_id=parent.model_call_id if parent is not None else None,
                edge_method=e.method if e is not None else (boundary and RECORDED_PARENT_METHOD),
                edge_status=e.status if e is not None else boundary,
                shared_len=e.shared_len if e is not None else None,
                response_id=c.response_id,
                output_items=list(_json_of(c.output_items) or []),
                token_item_index=c.token_item_index,
                request_fingerprint=c.request_fingerprint or "",
                continuation_fingerprint=c.continuation_fingerprint or "",
                model=c.model or "",
                prefix_requested=_prefix_flag(extra, "prefix_requested"),
                prefix_supplied=_prefix_flag(extra, "prefix_supplied"),
            )
        )
    return views


def _prefix_flag(extra: Any, name: str) -> bool | None:
    """A prefix-supply flag of a stored call: ``None`` when the call was not captured with
    prefix supply on.  The proxy stores its ``prefix_context`` digest on every call it captures
    with supply on; a ``False`` flag equals the record default and is not kept in ``extra``."""
    extra = extra or {}
    if name in extra:
        return bool(extra[name])
    return False if "prefix_context" in extra else None


def _recorded_boundary(extra: Any) -> str | None:
    """For a call with no edge (its decoded ``extra``): ``unresolved`` or ``missing`` when its
    writer recorded an unresolved parent or a parent the ledger could not link, ``None`` for a
    root."""
    decision = decision_of_stored(_Extra(extra))
    if decision is None or decision.status == "root":
        return None
    return "unresolved" if decision.status == "unresolved" else "missing"


class _Extra:
    """A stored call as ``decision_of_stored`` reads it: only its decoded ``extra``."""

    __slots__ = ("extra",)

    def __init__(self, extra: Any) -> None:
        self.extra = extra


def _json_of(text: str | None) -> Any:
    """A JSON column's stored text, decoded (``None`` for SQL NULL).  Text orjson refuses
    (``NaN``, integers beyond 64 bits: the stdlib encoder writes both) goes to the stdlib."""
    return None if text is None else jsonio.loads(text)


def _entries_from_rows(rows: Sequence[Any]) -> tuple[list[TokenEntry], list[tuple[str, str]]]:
    """Rebuild full-prompt entries (replaying delta chains); list the calls that cannot be."""
    cumulative: dict[str, bytes] = {}
    entries: list[TokenEntry] = []
    broken: list[tuple[str, str]] = []
    for r in rows:
        prompt = codec.load_ids(r.ids_codec, r.prompt_ids)
        generation = codec.load_ids(r.ids_codec, r.generation_ids)
        if r.prompt_is_delta:
            base = cumulative.get(r.parent_call_id)
            if base is None:
                broken.append((r.model_call_id, f"parent {r.parent_call_id!r} unavailable"))
                continue
            prompt = base + prompt
        full = prompt + generation
        if codec.token_digest(full) != r.cumulative_digest:
            broken.append((r.model_call_id, "cumulative digest mismatch"))
            continue
        cumulative[r.model_call_id] = full
        entries.append(
            TokenEntry.model_validate(
                {
                    "schema_version": r.schema_version,
                    "rollout_id": r.rollout_id,
                    "model_call_id": r.model_call_id,
                    "model": r.model,
                    "prompt_token_ids": codec.unpack_ids(prompt),
                    "generation_token_ids": codec.unpack_ids(generation),
                    "generation_log_probs": codec.unpack_log_probs(r.log_prob_codec, r.log_probs),
                    "routed_experts": r.routed_experts,
                    "output_items": r.output_items or [],
                    "token_item_index": r.token_item_index,
                    "created_at": r.created_at,
                    "response_id": r.response_id,
                    **(r.extra or {}),
                }
            )
        )
    return entries, broken


def _replay_chain(rows: Sequence[Any]) -> list[ChainLinkTokens]:
    """Turn root-first chain rows into links whose ``prompt_suffix`` is only the new context.

    One running SHA-256 over the chain's tokens proves every link: after each call it must
    equal the call's stored cumulative digest (the digest of its full prompt + generation).  A
    record that stores its full prompt contributes only the part beyond its parent's
    cumulative tokens; if that prompt did not extend the parent byte for byte, the running
    digest (parent's tokens + the rest) could not equal its stored digest, so the proof needs
    no second O(context) comparison per call.
    """
    links: list[ChainLinkTokens] = []
    done = 0  # tokens of the chain so far (prompt + generation of the calls replayed)
    running = codec.RunningDigest()
    for i, r in enumerate(rows):
        if i == 0 and r.prompt_is_delta:
            raise InvalidRecord(f"chain root {r.model_call_id!r} stores only a delta prompt")
        prompt = codec.load_ids(r.ids_codec, r.prompt_ids)
        generation = codec.load_ids(r.ids_codec, r.generation_ids)
        suffix: bytes | memoryview
        if r.prompt_is_delta:
            suffix = prompt
        else:
            if len(prompt) < done * 4:
                raise InvalidRecord(f"call {r.model_call_id!r} does not extend its parent")
            suffix = memoryview(prompt)[done * 4 :]
        running.update(suffix)
        running.update(generation)
        done += (len(suffix) + len(generation)) // 4
        if done != r.cumulative_len or running.hexdigest() != r.cumulative_digest:
            raise InvalidRecord(f"call {r.model_call_id!r} does not match its cumulative digest")
        links.append(
            ChainLinkTokens(
                model_call_id=r.model_call_id,
                prompt_suffix=codec.unpack_ids(bytes(suffix)),
                generation_token_ids=codec.unpack_ids(generation),
                generation_log_probs=codec.unpack_log_probs(r.log_prob_codec, r.log_probs),
                output_items=list(_json_of(r.output_items) or []),
                token_item_index=r.token_item_index,
                routed_experts=_json_of(r.routed_experts),
            )
        )
    return links
