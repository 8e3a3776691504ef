"""Conformance kit: prove a capture transport keeps the sink/source/lineage promises.

``await run_conformance(sink_factory=…, source_factory=…, lineage_factory=…)`` runs the checks
of NeMo Gym 0.7.0's kit, in its order and under its names, and returns the names of the checks
that passed; the first failure raises ``ConformanceError`` naming the check (``check`` and, as
in the release, ``check_name``).  Factories must return a *fresh* client on every call: several
checks prove that one client sees another's committed writes.  Every check uses its own rollout
id, ``<rollout_id>-<check-name>``.  Records are stamped as Gym's serving path stamps them (root
lineage, continuation metadata for one user request), and the lineage checks resolve request
items as 0.7.0's ``LineageResolver`` does.  The release's own kit runs against the ledger in
``tests/test_gym_release.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from ledger.errors import ConformanceError
from ledger.gym_lineage import stamp_continuation
from ledger.records import ParentResolutionStatus, TokenEntry, gym_token_digest

__all__ = ["CHECKS", "ConformanceError", "run_conformance"]

Factory = Callable[[], Any]
FIXED_CREATED_AT = 1700000000.0

CHECKS = (
    "put_then_freeze_visibility",
    "idempotent_reput",
    "conflicting_reput",
    "mark_incomplete_durability",
    "freeze_idempotency",
    "post_freeze_write_safety",
    "conditional_retirement",
    "lineage_visibility",
    "fresh_client_lineage_visibility",
    "begin_call_custody",
)


REQUEST: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]


def _entry(
    rollout_id: str, call_id: str, prompt: list[int], gen: list[int], text: str = "It is sunny."
) -> TokenEntry:
    """A committed record as Gym's serving path writes it: root lineage, continuation stamp."""
    entry = TokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        model="conformance",
        prompt_token_ids=prompt,
        generation_token_ids=gen,
        generation_log_probs=[-0.5 - i / 8 for i in range(len(gen))],
        output_items=[
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
            }
        ],
        token_item_index=0,
        created_at=FIXED_CREATED_AT,
    )
    stamp_continuation(entry, REQUEST)
    entry.parent_resolution = ParentResolutionStatus.ROOT
    entry.cum_len = len(prompt) + len(gen)
    entry.digest = gym_token_digest([*prompt, *gen])
    return entry


PROMPT = [1, 9690, 198, 2683, 359, 253, 2, 198, 1, 4093, 198, 36218, 2, 198, 1, 520, 9531, 198]
GEN = [49, 103, 14143, 17, 2]
NEXT_USER = [198, 1, 4093, 198, 5248, 30, 2, 198, 1, 520, 9531, 198]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _Run:
    def __init__(
        self,
        sink_factory: Factory,
        source_factory: Factory,
        lineage_factory: Factory | None,
        rollout_id: str,
    ) -> None:
        self.sink_factory = sink_factory
        self.source_factory = source_factory
        self.lineage_factory = lineage_factory
        self.rollout_id = rollout_id
        self.clients: list[Any] = []
        self.used: list[str] = []

    def _track(self, client: Any) -> Any:
        self.clients.append(client)
        return client

    def sink(self) -> Any:
        return self._track(self.sink_factory())

    def source(self) -> Any:
        return self._track(self.source_factory())

    def lineage(self) -> Any:
        assert self.lineage_factory is not None
        return self._track(self.lineage_factory())

    def rid(self, check: str) -> str:
        rid = f"{self.rollout_id}-{check.replace('_', '-')}"
        if rid not in self.used:
            self.used.append(rid)
        return rid

    async def clean_up(self) -> None:
        """Remove every rollout the checks wrote (the kit must leave the ledger as it was).

        Deleting needs the ledger's ``delete_rollout`` (direct database, or the admin scope over
        HTTP); where that is refused, each rollout is frozen and retired instead, leaving only
        tombstones that ``rollout-ledger sweep`` removes.
        """
        if not self.used:
            return
        source = self.source()
        backend = getattr(source, "backend", source)
        delete = getattr(backend, "delete_rollout", None)
        for rid in self.used:
            with contextlib.suppress(Exception):
                if delete is not None:
                    await _maybe_await(delete(rid))
                    continue
            with contextlib.suppress(Exception):
                snap = await _maybe_await(source.freeze(rid))
                await _maybe_await(
                    source.drop(rid, snapshot_id=snap.snapshot_id, version=snap.version)
                )

    async def close_all(self) -> None:
        for c in self.clients:
            close = getattr(c, "close", None)
            if close is not None:
                # Closing is best effort: the checks already ran.
                with contextlib.suppress(Exception):
                    await _maybe_await(close())


def _require(check: str, cond: bool, detail: str) -> None:
    if not cond:
        raise ConformanceError(check, detail)


async def _put_then_freeze_visibility(run: _Run, name: str) -> None:
    rid = run.rid(name)
    entry = _entry(rid, "call-1", PROMPT, GEN)
    await run.sink().put(entry)
    snap = await run.source().freeze(rid)
    _require(name, len(snap.entries) == 1, f"expected 1 entry, got {len(snap.entries)}")
    _require(name, not snap.incomplete, "snapshot is incomplete after a clean put")
    _require(name, bool(snap.snapshot_id), "snapshot id is empty")
    got = snap.entries[0]
    got_json = got.model_dump_json() if hasattr(got, "model_dump_json") else str(got)
    _require(name, got_json == entry.model_dump_json(), "entry did not round-trip its JSON dump")


async def _idempotent_reput(run: _Run, name: str) -> None:
    rid = run.rid(name)
    entry = _entry(rid, "call-1", PROMPT, GEN)
    await run.sink().put(entry)
    await run.sink().put(entry.model_copy(deep=True))
    snap = await run.source().freeze(rid)
    _require(name, len(snap.entries) == 1, f"expected 1 entry, got {len(snap.entries)}")
    _require(name, not snap.incomplete, "a byte-identical re-put made the rollout incomplete")


async def _conflicting_reput(run: _Run, name: str) -> None:
    rid = run.rid(name)
    await run.sink().put(_entry(rid, "call-1", PROMPT, GEN))
    raised = False
    try:
        await run.sink().put(_entry(rid, "call-1", PROMPT, [*GEN[:-1], 7, 2]))
    except Exception:
        raised = True
    snap = await run.source().freeze(rid)
    _require(
        name, raised or snap.incomplete, "a conflicting re-put neither raised nor marked incomplete"
    )
    gens = [list(e.generation_token_ids) for e in snap.entries]
    _require(name, gens == [GEN], f"the first record did not survive unchanged: {gens}")


async def _mark_incomplete_durability(run: _Run, name: str) -> None:
    rid = run.rid(name)
    await run.sink().put(_entry(rid, "call-1", PROMPT, GEN))
    first = await run.source().freeze(rid)
    await run.sink().mark_incomplete(rid, "call-2")
    again = await run.source().freeze(rid)
    _require(name, again.incomplete, "mark_incomplete after freeze not visible to a fresh client")
    _require(name, again.version != first.version, "mark_incomplete did not change the version")
    dropped = await run.source().drop(rid, snapshot_id=first.snapshot_id, version=first.version)
    _require(name, dropped is False, "a stale drop succeeded after mark_incomplete")


async def _freeze_idempotency(run: _Run, name: str) -> None:
    rid = run.rid(name)
    await run.sink().put(_entry(rid, "call-1", PROMPT, GEN))
    a = await run.source().freeze(rid)
    b = await run.source().freeze(rid)
    _require(name, a.snapshot_id == b.snapshot_id, "a second freeze changed the snapshot id")
    _require(name, a.version == b.version, "a second freeze changed the version")
    da = {e.model_call_id: e.model_dump_json() for e in a.entries}
    db = {e.model_call_id: e.model_dump_json() for e in b.entries}
    _require(name, da == db, "two freezes returned different entries")


async def _post_freeze_write_safety(run: _Run, name: str) -> None:
    rid = run.rid(name)
    await run.sink().put(_entry(rid, "call-1", PROMPT, GEN))
    snap = await run.source().freeze(rid)
    try:
        await run.sink().put(_entry(rid, "call-late", [*PROMPT, *GEN, *NEXT_USER], [5, 2]))
    except Exception:
        return
    dropped = await run.source().drop(rid, snapshot_id=snap.snapshot_id, version=snap.version)
    _require(name, dropped is False, "a write after freeze was accepted and a stale drop succeeded")


async def _conditional_retirement(run: _Run, name: str) -> None:
    rid = run.rid(name)
    await run.sink().put(_entry(rid, "call-1", PROMPT, GEN))
    snap = await run.source().freeze(rid)
    wrong = await run.source().drop(rid, snapshot_id=snap.snapshot_id, version=snap.version + 1)
    _require(name, wrong is False, "a drop with the wrong version succeeded")
    still = await run.source().freeze(rid)
    _require(name, len(still.entries) == 1, "a refused drop removed the entry")
    right = await run.source().drop(rid, snapshot_id=snap.snapshot_id, version=snap.version)
    _require(name, right is True, "a drop with the exact snapshot identity failed")


async def _lineage_checks(run: _Run, name: str, resolver_first: bool) -> None:
    rid = run.rid(name)
    resolver = run.lineage() if resolver_first else None
    entry = _entry(rid, "call-1", PROMPT, GEN)
    await run.sink().put(entry)
    if resolver is None:
        resolver = run.lineage()
    faithful = [*REQUEST, *entry.output_items, {"role": "user", "content": "And tomorrow?"}]
    res = await resolver.resolve(rid, faithful)
    _require(
        name,
        res.status == "resolved",
        f"a faithful continuation resolved as {res.status}: {res.reason}",
    )
    match = res.match
    _require(name, match.model_call_id == "call-1", f"resolved to {match.model_call_id!r}")
    _require(
        name,
        list(match.cumulative_token_ids) == [*PROMPT, *GEN],
        "resolved cumulative tokens differ from the parent's prompt + generation",
    )
    rewritten = [{"role": "user", "content": "REWRITTEN"}, *entry.output_items]
    res = await resolver.resolve(rid, rewritten)
    _require(name, res.status == "unresolved", f"a rewritten context resolved as {res.status}")
    res = await resolver.resolve(rid, [{"role": "user", "content": "fresh question"}])
    _require(name, res.status == "root", f"a request without model history is {res.status}")


async def _lineage_visibility(run: _Run, name: str) -> None:
    await _lineage_checks(run, name, resolver_first=True)


async def _fresh_client_lineage_visibility(run: _Run, name: str) -> None:
    await _lineage_checks(run, name, resolver_first=False)


async def _begin_call_custody(run: _Run, name: str) -> None:
    rid = run.rid(name)
    await run.sink().begin_call(rid, "call-never-committed")
    snap = await run.source().freeze(rid)
    _require(name, snap.incomplete, "an intent without a record left the snapshot complete")


_IMPL: dict[str, Callable[[_Run, str], Awaitable[None]]] = {
    "put_then_freeze_visibility": _put_then_freeze_visibility,
    "idempotent_reput": _idempotent_reput,
    "conflicting_reput": _conflicting_reput,
    "mark_incomplete_durability": _mark_incomplete_durability,
    "freeze_idempotency": _freeze_idempotency,
    "post_freeze_write_safety": _post_freeze_write_safety,
    "conditional_retirement": _conditional_retirement,
    "lineage_visibility": _lineage_visibility,
    "fresh_client_lineage_visibility": _fresh_client_lineage_visibility,
    "begin_call_custody": _begin_call_custody,
}


async def run_conformance(
    sink_factory: Factory,
    source_factory: Factory,
    lineage_factory: Factory | None = None,
    *,
    rollout_id: str | None = None,
) -> list[str]:
    """Run every applicable check; return the passed names or raise ``ConformanceError``."""
    run = _Run(
        sink_factory,
        source_factory,
        lineage_factory,
        rollout_id or f"conformance-{uuid.uuid4().hex[:10]}",
    )
    passed: list[str] = []
    probe = sink_factory()
    run.clients.append(probe)
    has_begin = callable(getattr(probe, "begin_call", None))
    try:
        for name in CHECKS:
            if name.endswith("lineage_visibility") and lineage_factory is None:
                continue
            if name == "begin_call_custody" and not has_begin:
                continue
            try:
                await _IMPL[name](run, name)
            except ConformanceError:
                raise
            except Exception as exc:
                raise ConformanceError(name, f"unexpected {type(exc).__name__}: {exc}") from exc
            passed.append(name)
    finally:
        try:
            await run.clean_up()
        finally:
            await run.close_all()
    return passed
