"""The ledger's transactional operations: the only module that writes SQL.

Every operation touches exactly one rollout and runs in one transaction that first takes that
rollout's lock (``SELECT … FOR UPDATE`` on Postgres; ``BEGIN IMMEDIATE`` on SQLite), so state
checks and the writes that depend on them cannot interleave with another writer.  Each public
method's docstring states the promise it keeps (design §4); refusals raise ``ledger.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ledger import codec
from ledger.builder import RECORDED_PARENT_METHOD
from ledger.engine import READ_ONLY, make_engine, make_sync_engine
from ledger.errors import (
    InvalidInput,
    InvalidRecord,
    LedgerError,
    NotFound,
    RolloutFrozen,
    RolloutRetired,
    Unavailable,
)
from ledger.gym_delta import materialize_delta
from ledger.ids import MAX_CALL_ID_LEN, is_valid_id, validate_call_id, validate_rollout_id
from ledger.lineage_ingest import decision_of_stored
from ledger.model import CallView, ChainLinkTokens, Quarantine
from ledger.records import TokenEntry, coerce_entry
from ledger.storage import ingest
from ledger.storage.tips import TipCache
from ledger.tables import (
    Call,
    CallTokens,
    Delivery,
    IncompleteEvent,
    LineageEdge,
    QuarantineRow,
    Rollout,
    utcnow,
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
]

R = cast(sa.Table, Rollout.__table__)
C = cast(sa.Table, Call.__table__)
T = cast(sa.Table, CallTokens.__table__)
E = cast(sa.Table, LineageEdge.__table__)
Q = cast(sa.Table, QuarantineRow.__table__)
IE = cast(sa.Table, IncompleteEvent.__table__)
D = cast(sa.Table, Delivery.__table__)

_T = TypeVar("_T")
_REASON_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# Arrays above this many tokens are packed and hashed in a worker thread (keeps the loop free).
_OFFLOAD_TOKENS = 20_000


@dataclass(frozen=True, slots=True)
class RolloutState:
    rollout_id: str
    state: str
    incomplete: bool
    snapshot_id: str | None
    version: int


@dataclass(frozen=True, slots=True)
class PutResult:
    """``status`` is ``created`` or ``duplicate`` (a byte-identical repeat: nothing changed)."""

    status: str
    version: int
    parent_call_id: str | None = None
    prompt_is_delta: bool = False
    edge_method: str | None = None


@dataclass(frozen=True, slots=True)
class LineageResolution:
    """The lineage store's answer for a candidate prompt (seed: lineage store).

    ``status``: ``root`` (no captured call's tokens prefix the prompt), ``resolved`` (the proven
    parent and its exact cumulative tokens), ``unresolved`` (the ledger cannot decide; ``reason``).
    """

    status: str
    model_call_id: str | None = None
    cumulative_token_ids: list[int] | None = None
    digest: str | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ContinuationCandidate:
    """A captured call a request continues by conversation (see ``continuation_candidates``)."""

    model_call_id: str
    cumulative_len: int
    cumulative_digest: str
    generation_len: int
    extra: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FrozenSnapshot:
    """NeMo Gym's ``TokenCaptureSnapshot``: full-prompt entries from one consistent read."""

    rollout_id: str
    entries: tuple[TokenEntry, ...]
    incomplete: bool
    snapshot_id: str
    version: int


@dataclass(frozen=True, slots=True)
class SnapshotViews:
    """A frozen snapshot for the builder: call metadata and edges, no token arrays."""

    rollout_id: str
    calls: tuple[CallView, ...]
    n_calls: int
    incomplete: bool
    snapshot_id: str
    version: int
    incomplete_reasons: tuple[str, ...] = ()


# The record packed and hashed once (``ledger.storage.ingest``); kept under the old names.
_Prepared = ingest.Prepared


def _prepare(entry: TokenEntry, tips: TipCache | None = None) -> _Prepared:
    """Pack and hash a record (pure CPU; may run in a worker thread)."""
    return ingest.prepare(entry, tips)


def _validate_reason(reason: str) -> str:
    if not isinstance(reason, str) or not _REASON_RE.match(reason):
        raise InvalidInput(
            f"reason must be a short snake_case word (a-z, 0-9, _; at most 64); got {reason!r}"
        )
    return reason




def _storable_call_id(model_call_id: object, detail: str) -> tuple[str, str]:
    """The form of any call id an incomplete event can store, and the detail to store with it.

    A valid id is kept as is.  Anything else (a ``put`` may have refused it) is kept readable
    and bounded: NUL and lone surrogates, which neither database stores, are escaped, the text
    is cut to the column's 200 characters, and the full original goes into the detail.
    """
    text = model_call_id if isinstance(model_call_id, str) else repr(model_call_id)
    if not text or is_valid_id(text, MAX_CALL_ID_LEN):
        return text, detail
    storable = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if storable == text and len(text) <= MAX_CALL_ID_LEN:
        return text, detail
    note = f"model_call_id as sent: {storable[:1000]!r}"
    return storable[:MAX_CALL_ID_LEN], f"{detail}; {note}" if detail else note


class Ledger:
    """The SQL ledger over one database (a SQLite file or a Postgres database)."""

    def __init__(
        self,
        url: str,
        *,
        delta_records: bool = True,
        auto_migrate: bool = False,
        group_commit: bool | None = None,
        engine: AsyncEngine | None = None,
        flush_intents: bool = False,
        check_schema: bool = False,
    ):
        self.engine = engine or make_engine(url)
        self.url = url
        self.delta_records = delta_records
        self.auto_migrate = auto_migrate or check_schema
        self._may_migrate = auto_migrate
        # ``check_schema``: refuse (``NoLedger``) instead of creating or migrating a ledger; for
        # every client that is not ``db upgrade`` or ``serve`` (issue 13 item 9).
        # An intent's commit need not wait for its own flush: the call's next write (record,
        # cancel or incomplete mark) is flushed before the harness is answered and, later in
        # the same sequential log (SQLite WAL, Postgres WAL), makes the intent durable with it.
        # A process crash never loses a committed intent either way.
        self.flush_intents = flush_intents
        self.dialect = self.engine.dialect.name

        self._schema_ready = False
        self._schema_lock = asyncio.Lock()
        if group_commit is None:
            group_commit = self.dialect == "sqlite"
        self._group = _GroupCommit(self) if group_commit else None
        # Digest state of each rollout's latest calls: continuations hash only their suffix.
        self._tips = TipCache()
        # Postgres hot path: asyncpg directly (prepared statements), pools per event loop.
        self._pools: dict[bool, Any] = {}
        self._pool_loop: asyncio.AbstractEventLoop | None = None
        self._pool_lock = asyncio.Lock()

    async def close(self) -> None:
        if self._group is not None:
            await self._group.close()
        await self._close_pool()
        await self.engine.dispose()

    async def _close_pool(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            if self._pool_loop is asyncio.get_running_loop():
                await pool.close()
            else:
                pool.terminate()

    async def ensure_schema(self) -> None:
        """Migrate the database to head once per process (guarded against concurrent runs)."""
        if self._schema_ready:
            return
        async with self._schema_lock:
            if not self._schema_ready:
                from ledger import migrate

                if not self._may_migrate:
                    from ledger.presence import require_ledger

                    await require_ledger(self.url)
                elif await migrate.current_revision(self.url) != migrate.head_revision():
                    # Alembic's env runs its own event loop: give it a thread.
                    await asyncio.to_thread(migrate.upgrade, self.url)
                self._schema_ready = True

    # ----------------------------------------------------------------- transactions

    @contextlib.asynccontextmanager
    async def _translate(self) -> AsyncIterator[None]:
        """Translate driver errors into the ledger's tree, once."""
        try:
            yield
        except LedgerError:
            raise
        except Exception as exc:
            translated = _translate_error(exc)
            if translated is exc:
                raise
            raise translated from exc

    async def _transact(self, body: Callable[[Connection], _T], *, flush: bool = True) -> _T:
        """Run ``body`` in one write transaction and return only after it committed.

        Bodies are synchronous functions over a ``Connection``: on Postgres they run through
        asyncpg (``run_sync``); on SQLite they run in the group-commit writer thread, which
        shares one durable commit among concurrent writers.  ``flush=False`` (SQLite's writer
        only): the commit may skip its own flush when no other write of its batch needs one.
        """
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        if self._group is not None:
            return await self._group.submit(body, flush=flush)
        async with self._write() as aconn:
            return await aconn.run_sync(body)

    async def _run_steps(
        self, make: Callable[[bool], ingest.Steps], *, flush: bool = True, single: bool = False
    ) -> Any:
        """Run one hot-path operation (``ledger.storage.ingest``) and return after its commit
        (``flush=False``: a commit that need not wait for its own flush).

        SQLite: one write transaction in the group-commit writer.  Postgres: asyncpg with its
        statements folded (``make(True)``), in one transaction, or (``single``: an operation
        whose every statement is atomic on its own) in autocommit, one round trip per statement.
        """
        if self.dialect == "sqlite":
            return await self._transact(
                lambda conn: ingest.run_sqlite(conn.connection.dbapi_connection, make(False)),
                flush=flush,
            )
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        pool = await self._pg_pool(lazy=not flush)
        try:
            async with pool.acquire() as conn:
                if single:
                    return await ingest.run_postgres(conn, make(True))
                async with conn.transaction():
                    return await ingest.run_postgres(conn, make(True))
        except LedgerError:
            raise
        except Exception as exc:
            translated = _translate_pg_error(exc)
            if translated is exc:
                raise
            raise translated from exc

    async def _pg_pool(self, *, lazy: bool = False) -> Any:
        """The asyncpg pool of this event loop; ``lazy``: its sessions commit without waiting
        for the WAL flush (``synchronous_commit=off``), for intents."""
        loop = asyncio.get_running_loop()
        if self._pool_loop is not loop or lazy not in self._pools:
            async with self._pool_lock:
                if self._pool_loop is not loop:
                    for stale in self._pools.values():
                        stale.terminate()
                    self._pools = {}
                    self._pool_loop = loop
                if lazy not in self._pools:
                    self._pools[lazy] = await self._new_pool(lazy)
        return self._pools[lazy]

    async def _new_pool(self, lazy: bool) -> Any:
        import asyncpg

        from ledger.engine import PG_LOCK_TIMEOUT_MS, PG_STATEMENT_TIMEOUT_MS

        settings = {
            "lock_timeout": str(PG_LOCK_TIMEOUT_MS),
            "statement_timeout": str(PG_STATEMENT_TIMEOUT_MS),
            "application_name": "rollout-ledger",
        }
        if lazy:
            settings["synchronous_commit"] = "off"
        dsn = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            return await asyncpg.create_pool(
                dsn, min_size=1, max_size=4 if lazy else 10, server_settings=settings
            )
        except Exception as exc:
            raise Unavailable(f"ledger database unavailable: {exc}") from exc

    def _now(self) -> Any:
        return ingest.sqlite_now() if self.dialect == "sqlite" else utcnow()

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        async with self._translate(), self.engine.begin() as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        if self.auto_migrate and not self._schema_ready:
            await self.ensure_schema()
        async with self._translate(), self.engine.connect() as conn:
            conn = await conn.execution_options(**{READ_ONLY: True})
            async with conn.begin():
                yield conn

    def _insert(self, table: sa.Table) -> Any:
        return (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(table)

    def _lock_rollout(self, conn: Connection, rollout_id: str) -> RolloutState:
        """Create the rollout row if needed and lock it for the rest of the transaction."""
        conn.execute(
            self._insert(R)
            .values(rollout_id=rollout_id, state="open", incomplete=False, version=0)
            .on_conflict_do_nothing(index_elements=["rollout_id"])
        )
        row = (
            conn.execute(
                sa.select(R.c.state, R.c.incomplete, R.c.snapshot_id, R.c.version)
                .where(R.c.rollout_id == rollout_id)
                .with_for_update()
            )
        ).one()
        return RolloutState(rollout_id, row.state, row.incomplete, row.snapshot_id, row.version)

    def _bump(self, conn: Connection, rollout_id: str, **values: Any) -> int:
        row = (
            conn.execute(
                R.update()
                .where(R.c.rollout_id == rollout_id)
                .values(version=R.c.version + 1, updated_at=utcnow(), **values)
                .returning(R.c.version)
            )
        ).one()
        return int(row.version)

    def _add_incomplete(
        self, conn: Connection, rollout_id: str, call_id: str, reason: str, detail: str
    ) -> int:
        conn.execute(
            IE.insert().values(
                rollout_id=rollout_id, model_call_id=call_id, reason=reason, detail=detail[:4000]
            )
        )
        return self._bump(conn, rollout_id, incomplete=True)

    @staticmethod
    def _refuse_if_closed(state: RolloutState, what: str) -> None:
        if state.state == "retired":
            raise RolloutRetired(
                f"token capture for rollout {state.rollout_id} is retired; {what} refused",
                rollout_id=state.rollout_id,
            )
        if state.state == "frozen":
            raise RolloutFrozen(
                f"token capture for rollout {state.rollout_id} is already frozen; {what} refused",
                rollout_id=state.rollout_id,
            )

    # ----------------------------------------------------------------- ingest

    async def begin_call(
        self, rollout_id: str, model_call_id: str, *, route: str | None = None, model: str = ""
    ) -> bool:
        """Durably record a pre-dispatch intent (§4.6); refused after freeze or retire.

        Returns False when the call id was already registered (an idempotent repeat)."""
        validate_rollout_id(rollout_id)
        validate_call_id(model_call_id)

        now = self._now()
        created: bool = await self._run_steps(
            lambda folded: ingest.begin_call_steps(
                rollout_id, model_call_id, route, model or "", now, folded=folded
            ),
            flush=self.flush_intents,
            single=True,
        )
        return created

    async def cancel_call(self, rollout_id: str, model_call_id: str) -> bool:
        """Close an intent for a call that ended without generating; True if one was open."""
        validate_rollout_id(rollout_id)
        validate_call_id(model_call_id)

        def body(conn: Connection) -> bool:
            state = self._lock_rollout(conn, rollout_id)
            self._refuse_if_closed(state, "cancel_call")
            res = conn.execute(
                C.update()
                .where(
                    C.c.rollout_id == rollout_id,
                    C.c.model_call_id == model_call_id,
                    C.c.status == "intent",
                )
                .values(status="cancelled")
            )
            return bool(res.rowcount)

        return await self._transact(body)

    async def note_failed_attempt(
        self, rollout_id: str, model_call_id: str, *, reason: str, detail: str, retry_key: str
    ) -> bool:
        """Keep an intent whose upstream attempt produced no output open, for a retry to settle.

        A successful retry with the same ``retry_key`` cancels it
        (:meth:`settle_failed_attempts`); at freeze an unsettled one is a lost call: the rollout
        is incomplete with ``reason``.  True if an open intent was noted."""
        validate_rollout_id(rollout_id)
        validate_call_id(model_call_id)
        _validate_reason(reason)
        note = {"failed_attempt": {"reason": reason, "detail": detail, "retry_key": retry_key}}

        def body(conn: Connection) -> bool:
            state = self._lock_rollout(conn, rollout_id)
            self._refuse_if_closed(state, "note_failed_attempt")
            res = conn.execute(
                C.update()
                .where(
                    C.c.rollout_id == rollout_id,
                    C.c.model_call_id == model_call_id,
                    C.c.status == "intent",
                )
                .values(extra=note)
            )
            return bool(res.rowcount)

        return await self._transact(body)

    async def settle_failed_attempts(self, rollout_id: str, retry_key: str) -> list[str]:
        """Cancel the open failed attempts a successful retry with ``retry_key`` replaced (they
        produced nothing the harness saw); returns their call ids."""
        validate_rollout_id(rollout_id)
        noted = sa.select(C.c.id).where(
            C.c.rollout_id == rollout_id, C.c.status == "intent", C.c.extra.is_not(None)
        )
        # A plain read first: the common case (nothing failed) costs no write transaction.
        async with self._read() as conn:
            if (await conn.execute(noted.limit(1))).first() is None:
                return []

        def body(conn: Connection) -> list[str]:
            state = self._lock_rollout(conn, rollout_id)
            if state.state != "open":
                return []
            rows = conn.execute(
                sa.select(C.c.id, C.c.model_call_id, C.c.extra).where(
                    C.c.rollout_id == rollout_id, C.c.status == "intent", C.c.extra.is_not(None)
                )
            ).all()
            settled = [r for r in rows if _failed_attempt(r.extra).get("retry_key") == retry_key]
            if settled:
                conn.execute(
                    C.update()
                    .where(C.c.id.in_([r.id for r in settled]), C.c.status == "intent")
                    .values(status="cancelled")
                )
            return [r.model_call_id for r in settled]

        return await self._transact(body)

    async def put(
        self,
        entry: TokenEntry | dict[str, Any],
        *,
        route: str | None = None,
        request_fingerprint: str = "",
        continuation_fingerprint: str = "",
    ) -> PutResult:
        """Commit one call record with its proven lineage edge before returning (§4.1 to §4.3).

        A byte-identical repeat is a no-op; the same call id with other bytes is refused, marks
        the rollout incomplete and leaves the first record unchanged; a new record after freeze
        or anything after retire is refused.
        """
        entry = coerce_entry(entry)
        if entry.prompt_is_delta:  # a NeMo Gym delta record: prove lineage on its full prompt
            entry = await materialize_delta(entry, self._read_cumulative_bytes)
        n_tokens = len(entry.prompt_token_ids) + len(entry.generation_token_ids)
        if n_tokens > _OFFLOAD_TOKENS:
            prep = await asyncio.to_thread(ingest.prepare, entry, self._tips)
        else:
            prep = ingest.prepare(entry, self._tips)
        now = self._now()
        out: ingest.Outcome = await self._run_steps(
            lambda folded: ingest.put_steps(
                prep,
                route=route,
                request_fingerprint=request_fingerprint,
                continuation_fingerprint=continuation_fingerprint,
                delta_records=self.delta_records,
                now=now,
                folded=folded,
            )
        )
        if out.deferred is not None:
            raise out.deferred
        if out.status == "created" and out.pk is not None and prep.generation:
            self._tips.remember(entry.rollout_id, prep.tip(out.pk))
        parent = out.parent
        return PutResult(
            out.status,
            out.version,
            parent.model_call_id if parent else None,
            out.prompt_is_delta,
            parent.method if parent else None,
        )

    # ----------------------------------------------------------------- lineage

    _LENGTH_BATCH = 16

    def _candidate_filter(self, rollout_id: str) -> list[Any]:
        return [
            C.c.rollout_id == rollout_id,
            C.c.status == "captured",
            # An empty generation's cumulative tokens are its prompt: it would become the
            # parent of its own retry.
            C.c.generation_len > 0,
        ]

    def _prove_parent(
        self, conn: Connection, rollout_id: str, prompt: bytes, prompt_len: int
    ) -> _Parent | None:
        """The earlier call whose cumulative tokens are the longest prefix of ``prompt``.

        Candidate lengths are walked longest first, a batch at a time; the digests of the
        prompt's prefixes at those lengths are compared with the stored cumulative digests in
        SQL.  No token array is read except the winner's generation, which is checked
        byte-for-byte.  In an agent loop the longest candidate is the parent, so this is O(1)
        rows per call rather than O(calls so far).
        """
        upper = prompt_len
        while True:
            lengths = (
                (
                    conn.execute(
                        sa.select(C.c.cumulative_len)
                        .where(*self._candidate_filter(rollout_id), C.c.cumulative_len <= upper)
                        .group_by(C.c.cumulative_len)
                        .order_by(C.c.cumulative_len.desc())
                        .limit(self._LENGTH_BATCH)
                    )
                )
                .scalars()
                .all()
            )
            if not lengths:
                return None
            digests = codec.prefix_digests(prompt, lengths)
            match = sa.or_(
                *(
                    sa.and_(C.c.cumulative_len == n, C.c.cumulative_digest == digests[n])
                    for n in lengths
                )
            )
            rows = (
                conn.execute(
                    sa.select(C.c.id, C.c.model_call_id, C.c.cumulative_len, C.c.generation_len)
                    .where(*self._candidate_filter(rollout_id), match)
                    .order_by(C.c.cumulative_len.desc(), C.c.model_call_id)
                )
            ).all()
            if rows:
                best = rows[0].cumulative_len
                tied = [r for r in rows if r.cumulative_len == best]
                return self._verified(conn, prompt, tied)
            upper = min(lengths) - 1

    def _verified(self, conn: Connection, prompt: bytes, tied: Sequence[Any]) -> _Parent | None:
        """Check the winner's sampled tokens byte-for-byte (the digest covers the rest)."""
        win = tied[0]
        best = win.cumulative_len
        gen = (
            conn.execute(sa.select(T.c.generation_ids).where(T.c.call_id == win.id))
        ).scalar_one_or_none()
        if gen is None or prompt[(best - win.generation_len) * 4 : best * 4] != gen:
            return None
        method = "identical_retry" if len(tied) > 1 else "token_prefix"
        return _Parent(win.id, win.model_call_id, best, method)

    def _ancestry_query(self, rollout_id: str, model_call_id: str, *, to_anchor: bool) -> Any:
        """One recursive query walking verified parents from a call up to the root.

        With ``to_anchor`` the walk stops at the nearest record that stores a full prompt.
        """
        base = sa.select(
            C.c.id, C.c.parent_call_id, C.c.prompt_is_delta, sa.literal(0).label("depth")
        ).where(C.c.rollout_id == rollout_id, C.c.model_call_id == model_call_id)
        chain = base.cte("chain", recursive=True)
        parent = C.alias("p")
        step = sa.select(
            parent.c.id, parent.c.parent_call_id, parent.c.prompt_is_delta, chain.c.depth + 1
        ).where(
            parent.c.rollout_id == rollout_id,
            parent.c.model_call_id == chain.c.parent_call_id,
            chain.c.depth < 1_000_000,
        )
        if to_anchor:
            step = step.where(chain.c.prompt_is_delta)
        chain = chain.union_all(step)
        return (
            sa.select(
                C.c.model_call_id,
                C.c.parent_call_id,
                C.c.prompt_is_delta,
                C.c.prompt_len,
                C.c.cumulative_len,
                C.c.cumulative_digest,
                C.c.output_items,
                C.c.token_item_index,
                T.c.prompt_ids,
                T.c.generation_ids,
                T.c.log_probs,
                T.c.log_prob_codec,
                T.c.routed_experts,
            )
            .select_from(chain.join(C, C.c.id == chain.c.id).join(T, T.c.call_id == C.c.id))
            .order_by(chain.c.depth.desc())
        )

    async def _read_cumulative_bytes(self, rollout_id: str, model_call_id: str) -> bytes:
        """``_cumulative_bytes`` in a read transaction of its own."""
        async with self._read() as aconn:
            return await aconn.run_sync(self._cumulative_bytes, rollout_id, model_call_id)

    def _cumulative_bytes(self, conn: Connection, rollout_id: str, model_call_id: str) -> bytes:
        """A call's full prompt+generation, rebuilt from its nearest full record and checked."""
        rows = (conn.execute(self._ancestry_query(rollout_id, model_call_id, to_anchor=True))).all()
        if not rows or rows[0].prompt_is_delta:
            raise InvalidRecord(f"call {model_call_id!r} cannot be reconstructed: no full record")
        buf = bytearray()
        for r in rows:
            buf += r.prompt_ids
            buf += r.generation_ids
        data = bytes(buf)
        if codec.token_digest(data) != rows[-1].cumulative_digest:
            raise InvalidRecord(f"call {model_call_id!r} does not match its cumulative digest")
        return data

    async def resolve(self, rollout_id: str, prompt_token_ids: Sequence[int]) -> LineageResolution:
        """The proven parent of a candidate prompt, seeing every committed record; never guesses."""
        validate_rollout_id(rollout_id)
        try:
            prompt = codec.pack_ids(prompt_token_ids)
        except InvalidRecord as exc:
            return LineageResolution("unresolved", reason=f"invalid_prompt: {exc}")

        def lookup(conn: Connection) -> LineageResolution:
            state = conn.execute(
                sa.select(R.c.state).where(R.c.rollout_id == rollout_id)
            ).scalar_one_or_none()
            if state == "retired":
                return LineageResolution("unresolved", reason="rollout_retired")
            parent = self._prove_parent(conn, rollout_id, prompt, len(prompt) // 4)
            if parent is None:
                return LineageResolution("root", reason="no_match")
            try:
                cumulative = self._cumulative_bytes(conn, rollout_id, parent.model_call_id)
            except InvalidRecord as exc:
                return LineageResolution("unresolved", reason=f"reconstruction_failed: {exc}")
            return LineageResolution(
                "resolved",
                parent.model_call_id,
                codec.unpack_ids(cumulative),
                codec.token_digest(cumulative),
            )

        async with self._read() as aconn:
            return await aconn.run_sync(lookup)

    async def continuation_candidates(
        self, rollout_id: str, fingerprint: str
    ) -> list[ContinuationCandidate]:
        """Captured calls of the rollout whose continuation fingerprint is ``fingerprint`` (the
        request-time, conversation-level lineage lookup of prefix supply), by call id."""
        validate_rollout_id(rollout_id)
        if not fingerprint:
            return []
        query = (
            sa.select(
                C.c.model_call_id,
                C.c.cumulative_len,
                C.c.cumulative_digest,
                C.c.generation_len,
                C.c.extra,
            )
            .where(
                C.c.rollout_id == rollout_id,
                C.c.status == "captured",
                C.c.continuation_fingerprint == fingerprint,
            )
            .order_by(C.c.model_call_id)
        )
        async with self._read() as conn:
            rows = (await conn.execute(query)).all()
        return [
            ContinuationCandidate(
                r.model_call_id,
                r.cumulative_len,
                r.cumulative_digest,
                r.generation_len,
                dict(r.extra or {}),
            )
            for r in rows
        ]

    async def cumulative_token_ids(self, rollout_id: str, model_call_id: str) -> list[int]:
        """A captured call's full prompt + generation, rebuilt and checked against its digest."""
        validate_rollout_id(rollout_id)
        validate_call_id(model_call_id)

        def read(conn: Connection) -> list[int]:
            return codec.unpack_ids(self._cumulative_bytes(conn, rollout_id, model_call_id))

        async with self._read() as aconn:
            return await aconn.run_sync(read)

    # ----------------------------------------------------------------- incomplete / freeze

    async def mark_incomplete(
        self, rollout_id: str, model_call_id: str = "", *, reason: str, detail: str = ""
    ) -> int:
        """Durably mark the rollout incomplete (allowed after freeze; bumps the version)."""
        validate_rollout_id(rollout_id)
        # More available than ``put`` (NeMo Gym's TokenSink contract): the call id is whatever
        # the writer used, including one ``put`` refused, so it is stored, never validated.
        call_id, detail = _storable_call_id(model_call_id, detail)
        _validate_reason(reason)

        def body(conn: Connection) -> int:
            state = self._lock_rollout(conn, rollout_id)
            if state.state == "retired":
                raise RolloutRetired(
                    f"token capture for rollout {rollout_id} is retired; mark_incomplete refused",
                    rollout_id=rollout_id,
                )
            return self._add_incomplete(conn, rollout_id, call_id, reason, detail)

        return await self._transact(body)

    def _freeze_in(self, conn: Connection, rollout_id: str) -> RolloutState:
        state = self._lock_rollout(conn, rollout_id)
        if state.state == "retired":
            raise RolloutRetired(
                f"token capture for rollout {rollout_id} is retired; freeze refused",
                rollout_id=rollout_id,
            )
        if state.state == "frozen":
            return state
        dangling = (
            conn.execute(
                sa.select(C.c.model_call_id, C.c.extra).where(
                    C.c.rollout_id == rollout_id, C.c.status == "intent"
                )
            )
        ).all()
        for cid, extra in dangling:
            failed = _failed_attempt(extra)
            conn.execute(
                IE.insert().values(
                    rollout_id=rollout_id,
                    model_call_id=cid,
                    reason=failed.get("reason") or "dangling_intent",
                    detail=(
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
            rows = (
                conn.execute(
                    sa.select(C, T)
                    .join(T, T.c.call_id == C.c.id)
                    .where(C.c.rollout_id == rollout_id, C.c.status == "captured")
                    .order_by(C.c.id)
                )
            ).all()
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
                    sa.select(IE.c.model_call_id).where(
                        IE.c.rollout_id == state.rollout_id,
                        IE.c.reason == "delta_chain_unreconstructable",
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
        """Freeze and return call metadata and proven edges (no token arrays) in one read."""
        validate_rollout_id(rollout_id)

        def body(conn: Connection) -> SnapshotViews:
            state = self._freeze_in(conn, rollout_id)
            calls = (
                conn.execute(
                    sa.select(C)
                    .where(C.c.rollout_id == rollout_id, C.c.status == "captured")
                    .order_by(C.c.id)
                )
            ).all()
            edges = (
                conn.execute(
                    sa.select(E.c.child_id, E.c.parent_id, E.c.method, E.c.status, E.c.shared_len)
                    .where(E.c.rollout_id == rollout_id)
                    .order_by(E.c.id)
                )
            ).all()
            reasons = (
                (
                    conn.execute(
                        sa.select(IE.c.reason).where(IE.c.rollout_id == rollout_id).distinct()
                    )
                )
                .scalars()
                .all()
            )
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

        Walks verified parents in one recursive query; every link's cumulative digest is
        re-checked while the chain is replayed.  ``expect`` (the builder's plan) must match.
        """
        async with self._read() as conn:
            rows = (
                await conn.execute(
                    self._ancestry_query(rollout_id, terminal_call_id, to_anchor=False)
                )
            ).all()
        if not rows:
            raise InvalidRecord(f"call {terminal_call_id!r} has no captured record")
        ids = [r.model_call_id for r in rows]
        if expect is not None and list(expect) != ids:
            raise InvalidRecord(f"stored chain {ids} differs from the planned chain {list(expect)}")
        return _replay_chain(rows)

    # ----------------------------------------------------------------- retire / admin

    async def retire(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire exactly the consumed snapshot (§4.5): delete token payloads, keep a tombstone.

        Returns False, changing nothing, when the rollout is not frozen at that identity.
        """
        validate_rollout_id(rollout_id)

        def body(conn: Connection) -> bool:
            now = utcnow()
            hit = (
                conn.execute(
                    R.update()
                    .where(
                        R.c.rollout_id == rollout_id,
                        R.c.state == "frozen",
                        R.c.snapshot_id == snapshot_id,
                        R.c.version == version,
                    )
                    .values(state="retired", retired_at=now, updated_at=now)
                    .returning(R.c.rollout_id)
                )
            ).one_or_none()
            if hit is None:
                return False
            conn.execute(
                T.delete().where(
                    T.c.call_id.in_(sa.select(C.c.id).where(C.c.rollout_id == rollout_id))
                )
            )
            conn.execute(
                D.update()
                .where(
                    D.c.rollout_id == rollout_id,
                    D.c.snapshot_id == snapshot_id,
                    D.c.version == version,
                    D.c.outcome == "delivered",
                )
                .values(retired_at=now)
            )
            return True

        retired = await self._transact(body)
        if retired:
            self._tips.forget(rollout_id)
        return retired

    async def delete_rollout(self, rollout_id: str) -> bool:
        """Admin: remove every trace of a rollout (before re-dispatching its id)."""
        validate_rollout_id(rollout_id)

        def body(conn: Connection) -> bool:
            res = conn.execute(R.delete().where(R.c.rollout_id == rollout_id))
            return bool(res.rowcount)

        self._tips.forget(rollout_id)
        return await self._transact(body)

    async def sweep(self, older_than: timedelta) -> int:
        """Remove retired tombstones retired at or before ``now - older_than``."""
        cutoff = datetime.now(UTC) - older_than

        def body(conn: Connection) -> int:
            res = conn.execute(R.delete().where(R.c.state == "retired", R.c.retired_at <= cutoff))
            return int(res.rowcount or 0)

        return await self._transact(body)

    async def get_state(self, rollout_id: str) -> RolloutState:
        validate_rollout_id(rollout_id)
        async with self._read() as conn:
            row = (
                await conn.execute(
                    sa.select(R.c.state, R.c.incomplete, R.c.snapshot_id, R.c.version).where(
                        R.c.rollout_id == rollout_id
                    )
                )
            ).one_or_none()
        if row is None:
            raise NotFound(f"no rollout {rollout_id!r} in the ledger", rollout_id=rollout_id)
        return RolloutState(rollout_id, row.state, row.incomplete, row.snapshot_id, row.version)

    # ----------------------------------------------------------------- deliveries

    async def record_delivery(
        self,
        rollout_id: str,
        *,
        snapshot_id: str | None,
        version: int | None,
        outcome: str,
        mask_reasons: Sequence[str],
        metrics: dict[str, Any],
        terminal: dict[str, Any] | None,
        quarantines: Iterable[Quarantine] = (),
        consumer: str = "",
        idempotency_key: str | None = None,
    ) -> int:
        """Store one build of a snapshot with its outcome, reasons, metrics and quarantines."""

        def body(conn: Connection) -> int:
            self._lock_rollout(conn, rollout_id)
            if idempotency_key is not None:
                prior = (
                    conn.execute(sa.select(D.c.id).where(D.c.idempotency_key == idempotency_key))
                ).scalar_one_or_none()
                if prior is not None:
                    return int(prior)
            did = (
                conn.execute(
                    D.insert()
                    .values(
                        rollout_id=rollout_id,
                        snapshot_id=snapshot_id,
                        version=version,
                        outcome=outcome,
                        mask_reasons=list(mask_reasons),
                        metrics=metrics,
                        terminal=terminal,
                        consumer=consumer,
                        idempotency_key=idempotency_key,
                    )
                    .returning(D.c.id)
                )
            ).scalar_one()
            rows = [
                {
                    "rollout_id": rollout_id,
                    "delivery_id": did,
                    "model_call_id": q.model_call_id,
                    "reason": q.reason,
                    "detail": q.detail,
                }
                for q in quarantines
            ]
            if rows:
                conn.execute(Q.insert(), rows)
            return int(did)

        return await self._transact(body)

    async def mark_delivery(
        self, delivery_id: int, *, handed_off: bool = False, durable: bool = False
    ) -> None:
        """Stamp a delivery as handed off and/or durably acknowledged by the consumer."""
        values: dict[str, Any] = {}
        if handed_off:
            values["handed_off_at"] = utcnow()
        if durable:
            values["durable_ack_at"] = utcnow()
        if not values:
            return

        def body(conn: Connection) -> None:
            res = conn.execute(D.update().where(D.c.id == delivery_id).values(**values))
            if not res.rowcount:
                raise NotFound(f"no delivery {delivery_id} in the ledger")

        return await self._transact(body)


def _translate_pg_error(exc: Exception) -> Exception:
    """The ledger error for an asyncpg error on the hot path (unchanged if it is not one)."""
    from asyncpg import exceptions as pg

    if isinstance(exc, pg.IntegrityConstraintViolationError | pg.DataError):
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return InvalidInput(f"the database refused the value: {first}")
    return _translate_error(exc)


def _translate_error(exc: Exception) -> Exception:
    """The ledger error for a driver error (unchanged if it is not one)."""
    if isinstance(exc, LedgerError):
        return exc
    if isinstance(exc, IntegrityError | DataError):
        first = str(exc.orig).splitlines()[0] if str(exc.orig) else type(exc.orig).__name__
        return InvalidInput(f"the database refused the value: {first}")
    if isinstance(exc, OperationalError | DBAPIError | OSError | ConnectionError):
        return Unavailable(f"ledger database unavailable: {exc}")
    # asyncpg raises its own connection errors outside SQLAlchemy's wrapping on connect.
    if type(exc).__module__.startswith("asyncpg"):
        return Unavailable(f"ledger database unavailable: {exc}")
    return exc


class _GroupCommit:
    """Group commit for SQLite (design §8): concurrent writes share one durable commit.

    One writer thread owns a synchronous SQLite connection.  It takes every write queued while
    the previous batch was in flight and runs them in one ``BEGIN IMMEDIATE`` transaction.  A
    write that raises before changing anything (a refusal) just fails; one that raises after
    changing rows rolls the batch back, which then runs again with one SAVEPOINT per write, so
    a failing write never takes another's changes with it; a failed commit fails every write of
    the batch.  Nothing is acknowledged before its commit.

    Flushing is pipelined: the connection commits with ``synchronous=NORMAL`` (the WAL frames
    are written, and readable, but not yet flushed) and a flusher thread then ``fdatasync``s
    the WAL file, which is exactly the flush ``synchronous=FULL`` would do inside the commit,
    while the writer already runs the next batch.  A write that promises durability is
    acknowledged only after a flush that began after its commit; one that does not need its own
    flush (an intent: the call's flushed record carries it) is acknowledged at its commit.  The
    WAL is checkpointed into the database with its own flushes, as under ``NORMAL``.
    """

    MAX_BATCH = 256
    # Flusher threads: while one flush is in flight, another can start for later commits, so a
    # durable write waits for about one flush, not for the one in flight and then its own.
    FLUSHERS = 2

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._flushes: queue.SimpleQueue[list[_Outcome] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._flushers: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        self._engine: Engine | None = None
        self._db_path = os.path.abspath(str(ledger.engine.url.database or ""))

    async def submit(self, body: Callable[[Connection], _T], *, flush: bool = True) -> _T:
        self._ensure_thread()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[_T] = loop.create_future()
        self._queue.put((body, fut, loop, flush))
        return await asyncio.shield(fut)

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._engine = make_sync_engine(self.ledger.engine.url)
                self._thread = threading.Thread(
                    target=self._run, name="rollout-ledger-writer", daemon=True
                )
                self._flushers = [
                    threading.Thread(
                        target=self._flush_loop, name=f"rollout-ledger-flusher-{i}", daemon=True
                    )
                    for i in range(self.FLUSHERS)
                ]
                for flusher in self._flushers:
                    flusher.start()
                self._thread.start()

    async def close(self) -> None:
        thread, flushers = self._thread, self._flushers
        if thread is None:
            return
        self._queue.put(None)
        await asyncio.to_thread(thread.join)
        for _ in flushers:
            self._flushes.put(None)
        for flusher in flushers:
            await asyncio.to_thread(flusher.join)
        self._thread, self._flushers = None, []
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < self.MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[_Job]) -> None:
        """Run the batch in one transaction without savepoints; a write that fails after it
        changed something makes the whole transaction roll back and run again with one
        savepoint per write (so each write still succeeds or fails alone)."""
        assert self._engine is not None
        outcomes: list[_Outcome] = []
        try:
            with self._engine.connect() as conn:
                dbapi: Any = conn.connection.dbapi_connection
                self._unflushed_commits(dbapi)
                with conn.begin():
                    self._run_batch(conn, dbapi, batch, outcomes)
        except _Replay:
            self._commit_with_savepoints(batch)
            return
        except Exception as exc:  # the commit (or the transaction) failed: nothing is durable
            failure = _translate_error(exc)
            for job in batch:
                _resolve(job, None, failure)
            return
        self._committed(outcomes)

    @staticmethod
    def _unflushed_commits(dbapi: Any) -> None:
        # Idempotent and cheap (no I/O); the engine's connect hook sets FULL.
        dbapi.execute("PRAGMA synchronous=NORMAL")

    @staticmethod
    def _run_batch(
        conn: Connection, dbapi: Any, batch: list[_Job], outcomes: list[_Outcome]
    ) -> None:
        for job in batch:
            changes = dbapi.total_changes
            try:
                outcomes.append((job, job[0](conn), None))
            except Exception as exc:
                if dbapi.total_changes != changes or not dbapi.in_transaction:
                    raise _Replay from exc
                # It failed before changing anything: nothing to undo.
                outcomes.append((job, None, _translate_error(exc)))

    def _commit_with_savepoints(self, batch: list[_Job]) -> None:
        assert self._engine is not None
        outcomes: list[_Outcome] = []
        try:
            with self._engine.begin() as conn:
                for job in batch:
                    try:
                        with conn.begin_nested():
                            outcomes.append((job, job[0](conn), None))
                    except Exception as exc:  # this write alone rolls back to its savepoint
                        outcomes.append((job, None, _translate_error(exc)))
        except Exception as exc:  # the commit (or the transaction) failed: nothing is durable
            failure = _translate_error(exc)
            for job in batch:
                _resolve(job, None, failure)
            return
        self._committed(outcomes)

    def _committed(self, outcomes: list[_Outcome]) -> None:
        """Acknowledge what needs no flush now; hand the rest to the flusher."""
        waiting: list[_Outcome] = []
        for out in outcomes:
            job, _value, error = out
            if job[3] and error is None:
                waiting.append(out)
            else:
                _resolve(*out)
        if waiting:
            self._flushes.put(waiting)

    def _flush_loop(self) -> None:
        while True:
            first = self._flushes.get()
            if first is None:
                return
            waiting = list(first)
            stop = False
            while True:
                try:
                    more = self._flushes.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                waiting += more
            try:
                self._flush_wal()
            except OSError as exc:
                failure = Unavailable(f"ledger database unavailable: flush failed: {exc}")
                for job, _value, _error in waiting:
                    _resolve(job, None, failure)
            else:
                for out in waiting:
                    _resolve(*out)
            if stop:
                return

    def _flush_wal(self) -> None:
        """``fdatasync`` the WAL (what a ``synchronous=FULL`` commit does); when there is no WAL
        file (checkpointed and removed), the database file holds the commits: flush it."""
        for path in (self._db_path + "-wal", self._db_path):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
            return


# (body, future, the caller's loop, whether its commit must wait for the flush)
_Job = tuple[Callable[[Connection], Any], "asyncio.Future[Any]", asyncio.AbstractEventLoop, bool]


_Outcome = tuple[_Job, Any, BaseException | None]


class _Replay(Exception):
    """A write failed after changing rows: roll the batch back and rerun it with savepoints."""


def _resolve(job: _Job, value: Any, error: BaseException | None) -> None:
    _body, fut, loop, _flush = job

    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    with contextlib.suppress(RuntimeError):  # the caller's loop is gone: nobody is waiting
        loop.call_soon_threadsafe(settle)


@dataclass(frozen=True, slots=True)
class _Parent:
    pk: int
    model_call_id: str
    cumulative_len: int
    method: str


def _failed_attempt(extra: Any) -> dict[str, Any]:
    """The failed-attempt note of an intent row's ``extra`` (empty when there is none)."""
    note = extra.get("failed_attempt") if isinstance(extra, dict) else None
    return note if isinstance(note, dict) else {}


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
        boundary = _recorded_boundary(c) if e is None else None
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
                output_items=list(c.output_items or []),
                token_item_index=c.token_item_index,
                request_fingerprint=c.request_fingerprint or "",
                continuation_fingerprint=c.continuation_fingerprint or "",
                model=c.model or "",
                prefix_requested=_prefix_flag(c.extra, "prefix_requested"),
                prefix_supplied=_prefix_flag(c.extra, "prefix_supplied"),
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


def _recorded_boundary(call: Any) -> str | None:
    """For a call with no edge: ``unresolved`` or ``missing`` when its writer recorded an
    unresolved parent or a parent the ledger could not link, ``None`` for a root."""
    decision = decision_of_stored(call)
    if decision is None or decision.status == "root":
        return None
    return "unresolved" if decision.status == "unresolved" else "missing"


def _entries_from_rows(rows: Sequence[Any]) -> tuple[list[TokenEntry], list[tuple[str, str]]]:
    """Rebuild full-prompt entries (replaying delta chains); list the calls that cannot be."""
    cumulative: dict[str, bytes] = {}
    entries: list[TokenEntry] = []
    broken: list[tuple[str, str]] = []
    for r in rows:
        prompt = r.prompt_ids
        if r.prompt_is_delta:
            base = cumulative.get(r.parent_call_id)
            if base is None:
                broken.append((r.model_call_id, f"parent {r.parent_call_id!r} unavailable"))
                continue
            prompt = base + prompt
        full = prompt + r.generation_ids
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
                    "generation_token_ids": codec.unpack_ids(r.generation_ids),
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
    """Turn root-first chain rows into links whose ``prompt_suffix`` is only the new context."""
    links: list[ChainLinkTokens] = []
    cum = bytearray()
    running = codec.RunningDigest()
    for i, r in enumerate(rows):
        if i == 0 and r.prompt_is_delta:
            raise InvalidRecord(f"chain root {r.model_call_id!r} stores only a delta prompt")
        if r.prompt_is_delta:
            suffix = r.prompt_ids
        else:
            if r.prompt_ids[: len(cum)] != bytes(cum):
                raise InvalidRecord(f"call {r.model_call_id!r} does not extend its parent")
            suffix = r.prompt_ids[len(cum) :]
        cum += suffix
        cum += r.generation_ids
        running.update(suffix)
        running.update(r.generation_ids)
        if running.hexdigest() != r.cumulative_digest:
            raise InvalidRecord(f"call {r.model_call_id!r} does not match its cumulative digest")
        links.append(
            ChainLinkTokens(
                model_call_id=r.model_call_id,
                prompt_suffix=codec.unpack_ids(suffix),
                generation_token_ids=codec.unpack_ids(r.generation_ids),
                generation_log_probs=codec.unpack_log_probs(r.log_prob_codec, r.log_probs),
                output_items=list(r.output_items or []),
                token_item_index=r.token_item_index,
                routed_experts=r.routed_experts,
            )
        )
    return links


# --------------------------------------------------------------------------- audit queries


@dataclass(frozen=True, slots=True)
class RolloutSummary:
    rollout_id: str
    state: str
    incomplete: bool
    version: int
    n_calls: int
    created_at: datetime
    updated_at: datetime
    outcome: str | None
    mask_reasons: list[str]
    delivered_fraction: float | None
    chains: int | None
    # The causes behind ``capture_incomplete`` (``upstream_error``, ``missing_token_ids``, …).
    incomplete_reasons: tuple[str, ...] = ()


class Audit:
    """Read-only audit queries (why was a rollout masked, what did a run look like)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def _latest_delivery(self) -> Any:
        return (
            sa.select(D.c.rollout_id, sa.func.max(D.c.id).label("did"))
            .group_by(D.c.rollout_id)
            .subquery("latest")
        )

    async def list_rollouts(
        self,
        *,
        state: str | None = None,
        outcome: str | None = None,
        masked: bool | None = None,
        reason: str | None = None,
        since: datetime | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> tuple[list[RolloutSummary], str | None]:
        """Rollouts ordered by id, filtered; returns a page and the cursor of the next one.

        ``reason`` matches a mask reason or an incomplete-event reason (the cause behind
        ``capture_incomplete``).
        """
        latest = self._latest_delivery()
        n_calls = (
            sa.select(sa.func.count())
            .where(C.c.rollout_id == R.c.rollout_id, C.c.status == "captured")
            .scalar_subquery()
        )
        q = (
            sa.select(
                R.c.rollout_id,
                R.c.state,
                R.c.incomplete,
                R.c.version,
                R.c.created_at,
                R.c.updated_at,
                n_calls.label("n_calls"),
                D.c.outcome,
                D.c.mask_reasons,
                D.c.metrics,
            )
            .select_from(
                R.outerjoin(latest, latest.c.rollout_id == R.c.rollout_id).outerjoin(
                    D, D.c.id == latest.c.did
                )
            )
            .order_by(R.c.rollout_id)
        )
        if state:
            q = q.where(R.c.state == state)
        if outcome:
            q = q.where(D.c.outcome == outcome)
        if masked is True:
            q = q.where(D.c.outcome.in_(("masked", "failed")))
        elif masked is False:
            q = q.where(D.c.outcome == "delivered")
        if since is not None:
            q = q.where(R.c.updated_at >= since)
        if cursor:
            q = q.where(R.c.rollout_id > cursor)
        out: list[RolloutSummary] = []
        batch = max(1, min(limit, 1000))
        async with self.ledger._read() as conn:
            result = await conn.stream(q.execution_options(yield_per=batch))
            async for r in result:
                reasons = list(r.mask_reasons or [])
                metrics = r.metrics or {}
                causes = tuple(str(c) for c in metrics.get("incomplete_reasons") or ())
                if reason and reason not in reasons and reason not in causes:
                    continue
                out.append(
                    RolloutSummary(
                        r.rollout_id,
                        r.state,
                        r.incomplete,
                        r.version,
                        r.n_calls,
                        r.created_at,
                        r.updated_at,
                        r.outcome,
                        reasons,
                        metrics.get("delivered_fraction"),
                        metrics.get("chains"),
                        causes,
                    )
                )
                if len(out) > limit:
                    break
            await result.close()
        next_cursor = out[limit - 1].rollout_id if len(out) > limit else None
        return out[:limit], next_cursor

    async def rollout_detail(self, rollout_id: str) -> dict[str, Any]:
        """Everything about one rollout: calls, edges, quarantines, incomplete events, builds."""
        validate_rollout_id(rollout_id)
        async with self.ledger._read() as conn:
            head = (
                await conn.execute(sa.select(R).where(R.c.rollout_id == rollout_id))
            ).one_or_none()
            if head is None:
                raise NotFound(f"no rollout {rollout_id!r} in the ledger", rollout_id=rollout_id)
            calls = (
                await conn.execute(
                    sa.select(
                        C.c.id,
                        C.c.model_call_id,
                        C.c.status,
                        C.c.model,
                        C.c.route,
                        C.c.response_id,
                        C.c.prompt_len,
                        C.c.generation_len,
                        C.c.cumulative_len,
                        C.c.parent_call_id,
                        C.c.prompt_is_delta,
                        C.c.created_at,
                        C.c.registered_at,
                        C.c.recorded_at,
                        sa.exists().where(T.c.call_id == C.c.id).label("has_tokens"),
                    )
                    .where(C.c.rollout_id == rollout_id)
                    .order_by(C.c.id)
                )
            ).all()
            parent = C.alias("parent")
            child = C.alias("child")
            edges = (
                await conn.execute(
                    sa.select(
                        child.c.model_call_id.label("child"),
                        parent.c.model_call_id.label("parent"),
                        E.c.method,
                        E.c.status,
                        E.c.shared_len,
                        E.c.mismatch_pos,
                        E.c.mismatch_kind,
                    )
                    .join(child, child.c.id == E.c.child_id)
                    .join(parent, parent.c.id == E.c.parent_id)
                    .where(E.c.rollout_id == rollout_id)
                    .order_by(E.c.id)
                )
            ).all()
            quarantines = (
                await conn.execute(
                    sa.select(
                        Q.c.delivery_id, Q.c.model_call_id, Q.c.reason, Q.c.detail, Q.c.created_at
                    )
                    .where(Q.c.rollout_id == rollout_id)
                    .order_by(Q.c.id)
                )
            ).all()
            events = (
                await conn.execute(
                    sa.select(IE.c.model_call_id, IE.c.reason, IE.c.detail, IE.c.created_at)
                    .where(IE.c.rollout_id == rollout_id)
                    .order_by(IE.c.id)
                )
            ).all()
            deliveries = (
                await conn.execute(
                    sa.select(D).where(D.c.rollout_id == rollout_id).order_by(D.c.id)
                )
            ).all()
        return {
            "rollout": _row_dict(head),
            "calls": [_row_dict(c, drop=("id",)) for c in calls],
            "edges": [_row_dict(e) for e in edges],
            "quarantines": [_row_dict(q) for q in quarantines],
            "incomplete_events": [_row_dict(e) for e in events],
            "deliveries": [_row_dict(d) for d in deliveries],
        }

    async def stats(self, *, since: datetime | None = None) -> dict[str, Any]:
        """Counts by state, outcome and reason; mask fraction; delivered-fraction histogram."""
        latest = self._latest_delivery()
        async with self.ledger._read() as conn:
            sq = sa.select(R.c.state, sa.func.count()).group_by(R.c.state)
            if since is not None:
                sq = sq.where(R.c.updated_at >= since)
            states = {s: n for s, n in (await conn.execute(sq)).all()}
            dq = sa.select(D.c.outcome, D.c.mask_reasons, D.c.metrics).join(
                latest, latest.c.did == D.c.id
            )
            if since is not None:
                dq = dq.where(D.c.built_at >= since)
            outcomes: dict[str, int] = {}
            reasons: dict[str, int] = {}
            buckets = [0] * 11
            chains: dict[str, int] = {}
            result = await conn.stream(dq.execution_options(yield_per=1000))
            async for outcome, mask_reasons, metrics in result:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                for r in mask_reasons or []:
                    reasons[r] = reasons.get(r, 0) + 1
                metrics = metrics or {}
                frac = metrics.get("delivered_fraction")
                if isinstance(frac, int | float):
                    buckets[min(10, max(0, int(frac * 10)))] += 1
                n = metrics.get("chains")
                if isinstance(n, int):
                    key = str(n) if n < 5 else "5+"
                    chains[key] = chains.get(key, 0) + 1
            events: dict[str, int] = {
                reason: n
                for reason, n in (
                    await conn.execute(
                        sa.select(IE.c.reason, sa.func.count()).group_by(IE.c.reason)
                    )
                ).all()
            }
        built = sum(outcomes.values())
        masked = outcomes.get("masked", 0) + outcomes.get("failed", 0)
        return {
            "rollouts_by_state": states,
            "builds_by_outcome": outcomes,
            "mask_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
            "incomplete_events_by_reason": events,
            "mask_fraction": round(masked / built, 4) if built else None,
            "delivered_fraction_histogram": {
                f"{i / 10:.1f}" + ("" if i == 10 else f"-{(i + 1) / 10:.1f}"): n
                for i, n in enumerate(buckets)
            },
            "chains_histogram": chains,
        }


def _row_dict(row: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row._mapping.items():
        if key in drop:
            continue
        if isinstance(value, datetime):
            # SQLite returns naive datetimes; every stored time is UTC.
            value = (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
        out[key] = value
    return out
