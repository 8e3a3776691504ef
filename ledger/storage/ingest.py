"""The intent and the record, as step functions over the named statements.

Each operation is a generator that yields ``(statement name, parameters)`` and receives the
statement's rows; it returns its outcome.  :func:`run_sqlite` drives one on a DB-API SQLite
connection (inside the group-commit writer's transaction), :func:`run_postgres` on an asyncpg
connection (inside one transaction), so both dialects run the same logic and the same promises
(design §4.1-4.3, §4.6, §5.3) with plain prepared SQL.

Per call, typically: the intent is 2 statements (rollout state, intent row); the record is 6
(rollout state with the call's row, parent candidates, the record over its intent, its tokens,
its lineage edge, the version bump), plus one read of the parent's generation when the digest
cache did not see the parent written, and, for a proxied call, one update that cancels the
failed attempts of the same request (usually none) under the same lock.  On Postgres the
intent is one statement, and the record is optimistic: its reads run without the lock, each on
its own, and its writes are one statement that commits only if the rollout is still open at the
version the reads saw (else it runs again, under the lock, in one transaction); when this
ledger's own last write left the rollout at a version it remembers, and the recorded parent is
one it wrote, the record is that one statement alone.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ledger import codec
from ledger.builder import RECORDED_PARENT_METHOD
from ledger.errors import InvalidRecord, LedgerError, PayloadConflict, RolloutFrozen, RolloutRetired
from ledger.gym_delta import check_extension
from ledger.lineage_ingest import RecordedDecision, recorded_decision
from ledger.records import TokenEntry, payload_digest
from ledger.span import Span
from ledger.storage.statements import STATEMENTS
from ledger.storage.tips import PrefixHasher, Tip, TipCache

__all__ = [
    "NEED_LOCK",
    "OBSERVERS",
    "Outcome",
    "Parent",
    "Prepared",
    "begin_call_steps",
    "delivery_steps",
    "first_mismatch",
    "prepare",
    "prepare_delta",
    "put_steps",
    "run_postgres",
    "run_sqlite",
    "settle_failed",
    "settle_steps",
    "sqlite_now",
]

Step = tuple[str, tuple[Any, ...]]
Steps = Generator[Step, Sequence[Any], Any]

# What an optimistic record returns when it wrote nothing and must run under the lock.
NEED_LOCK: Any = object()

# Candidate parents are read this many at a time, longest first.
CANDIDATE_BATCH = 16

# Callables given each statement's text before it runs (tests watch what the hot path sends;
# SQLAlchemy's cursor events do not see it).
OBSERVERS: list[Callable[[str], None]] = []


def sqlite_now() -> str:
    """Now, as SQLAlchemy's SQLite ``DateTime`` stores it (UTC, no offset)."""
    return datetime.now(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")


def _json(value: Any) -> str | None:
    # The same text SQLAlchemy's JSON type writes (stdlib json: NaN stays refusable by Postgres).
    return None if value is None else json.dumps(value)


# --------------------------------------------------------------------------- the record, packed


@dataclass(slots=True)
class Prepared:
    """A record packed and hashed once, before its transaction."""

    entry: TokenEntry
    prompt: bytes
    generation: bytes
    lp_codec: str
    log_probs: bytes
    digest: str
    prompt_digest: str
    cumulative_digest: str
    hasher: PrefixHasher
    cumulative_state: Any
    extra: dict[str, Any] = field(default_factory=dict)
    # The stored form (``codec.store_ids``) made before the transaction, for the prompt from
    # the byte offset its likely delta starts at (the remembered tip's end; 0 for a full prompt).
    stored_from: int = -1
    stored: tuple[str, bytes, bytes] = ("", b"", b"")
    # The parent's cumulative tokens widened for NeMo Gym's digest and this record's new tokens
    # widened, when a delta record's check made them (its tip keeps them: ``Tip.gym_wide``).
    gym_wide: tuple[Span, bytearray] | None = None
    # The writer's recorded parent decision (``ledger.lineage_ingest``), read once.
    decision: RecordedDecision | None = None

    def stored_ids(self, prompt: bytes) -> tuple[str, bytes, bytes]:
        """``(ids_codec, prompt, generation)`` as stored, for the stored prompt ``prompt`` (the
        whole prompt or its suffix); the form :func:`prepare` made when it guessed the same
        suffix (the usual case), else made now."""
        if self.stored_from == len(self.prompt) - len(prompt):
            return self.stored
        return codec.store_ids(prompt, self.generation)

    @property
    def base(self) -> Tip | None:
        return self.hasher.base

    def tip(self, pk: int) -> Tip:
        """The committed call's tip.  A continuation's extends its base tip's buffers (the
        prompt starts with the base's cumulative tokens), so it costs its new tokens only."""
        base = self.hasher.base
        if base is None:
            cumulative = Span.of(self.prompt).extended(self.generation)
        else:
            cumulative = base.cumulative.extended(
                self.prompt[len(base.cumulative) :] + self.generation
            )
        wide = self.gym_wide[0].extended(self.gym_wide[1]) if self.gym_wide is not None else None
        return Tip(
            pk,
            self.entry.model_call_id,
            cumulative,
            self.cumulative_state,
            self.cumulative_digest,
            wide,
        )


def prepare(entry: TokenEntry, tips: TipCache | None = None) -> Prepared:
    """Pack and hash a record: the prompt's digest extends the longest remembered tip it starts
    with, so a continuation hashes only its new tokens (pure CPU; may run in a worker thread)."""
    prompt = entry.packed_ids("prompt_token_ids")
    base = tips.base_for(entry.rollout_id, prompt) if tips is not None else None
    return _prepared(entry, prompt, entry.packed_ids("generation_token_ids"), base)


def prepare_delta(entry: TokenEntry, tips: TipCache) -> Prepared | None:
    """A NeMo Gym delta record packed and hashed from its parent's tip, without materializing
    its prompt: the tip's packed cumulative tokens + the suffix are the prompt, its digest state
    extended by the suffix is the prompt's digest, and the record's ``cum_len``/``digest`` are
    checked on those bytes.  None when the parent's tip is not remembered (the caller
    reconstructs the prompt from the stored chain instead)."""
    if entry.parent_call_id is None:
        return None
    tip = tips.of_call(entry.rollout_id, entry.parent_call_id)
    if tip is None:
        return None
    generation = entry.packed_ids("generation_token_ids")
    suffix = entry.packed_ids("prompt_token_ids")
    with tip.cumulative.view() as base:
        prompt = b"".join((base, suffix))
    wide = check_extension(entry, tip.cumulative, tip.gym_wide, suffix + generation)
    prepared = _prepared(entry, prompt, generation, tip)
    prepared.gym_wide = wide
    return prepared


def _prepared(entry: TokenEntry, prompt: bytes, generation: bytes, base: Tip | None) -> Prepared:
    lp_codec, log_probs = codec.store_log_probs(entry.generation_log_probs)
    offset = len(base.cumulative) if base is not None else 0
    hasher = PrefixHasher(prompt, base)
    plen = len(prompt) // 4
    state = hasher.state_at(plen)
    prompt_digest = state.hexdigest()
    hasher.note(plen, prompt_digest)
    state.update(generation)
    return Prepared(
        entry=entry,
        prompt=prompt,
        generation=generation,
        lp_codec=lp_codec,
        log_probs=log_probs,
        digest=payload_digest(entry, prompt_digest, generation),
        prompt_digest=prompt_digest,
        cumulative_digest=state.hexdigest(),
        hasher=hasher,
        cumulative_state=state,
        extra=entry.extra_fields(),
        decision=recorded_decision(entry),
        stored_from=offset,
        stored=codec.store_ids(prompt[offset:], generation),
    )


@dataclass(frozen=True, slots=True)
class Parent:
    pk: int
    model_call_id: str
    cumulative_len: int
    method: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a record's transaction did: ``created``/``duplicate``, or a refusal to raise after
    the transaction committed (the conflicting-payload mark must commit)."""

    status: str
    version: int
    pk: int | None = None
    parent: Parent | None = None
    prompt_is_delta: bool = False
    deferred: LedgerError | None = None
    # The failed attempts this record's transaction cancelled (None: none were looked for).
    settled: tuple[str, ...] | None = None
    # Optimistic (Postgres): the rollout's version and creation time after this write.
    head: tuple[int, Any] | None = None


# --------------------------------------------------------------------------- steps


def refuse_if_closed(rollout_id: str, state: str, what: str) -> None:
    if state == "retired":
        raise RolloutRetired(
            f"token capture for rollout {rollout_id} is retired; {what} refused",
            rollout_id=rollout_id,
        )
    if state == "frozen":
        raise RolloutFrozen(
            f"token capture for rollout {rollout_id} is already frozen; {what} refused",
            rollout_id=rollout_id,
        )


def begin_call_steps(
    rollout_id: str,
    model_call_id: str,
    route: str | None,
    model: str,
    now: Any,
    *,
    folded: bool = False,
) -> Steps:
    """Register a call before dispatch; its row's id when it was new, None for a repeat
    (refused after freeze/retire).

    ``folded`` (Postgres): the lock, the state check and the insert are one statement, which
    can then run on its own (autocommit), one round trip."""
    if folded:
        args = (rollout_id, rollout_id, model_call_id, route, model, now)
        rows = yield ("intent_register", args)
        if not rows:
            yield ("rollout_create", (rollout_id, False, now, now))
            rows = yield ("intent_register", args)
        refuse_if_closed(rollout_id, rows[0][0], "begin_call")
        return None if rows[0][1] is None else int(rows[0][1])
    rows = yield ("rollout_state", (rollout_id,))
    if not rows:
        yield ("rollout_create", (rollout_id, False, now, now))
        rows = yield ("rollout_state", (rollout_id,))
    refuse_if_closed(rollout_id, rows[0][0], "begin_call")
    rows = yield ("intent_insert", (rollout_id, model_call_id, route, model, now, False))
    return int(rows[0][0]) if rows else None


def put_steps(
    prep: Prepared,
    *,
    route: str | None,
    request_fingerprint: str,
    continuation_fingerprint: str,
    delta_records: bool,
    now: Any,
    folded: bool = False,
    settle_key: str | None = None,
    optimistic: bool = False,
    head: tuple[int, Any, int | None] | None = None,
) -> Steps:
    """Commit one record with its proven lineage edge (design §4.1-4.3, §5.3).

    ``folded`` (Postgres): the record's writes go in one statement (one round trip).
    ``optimistic`` (Postgres, outside a transaction): the reads run without the rollout's lock,
    each on its own, and the one write commits only if the rollout is still open at the
    version the first read saw (every change to its captured calls bumps it); returns
    :data:`NEED_LOCK`, having written nothing, when that does not hold or when the record needs
    more than the one write (a new rollout, a repeat, a refusal, a drifted edge): the caller
    then runs the locked form.  ``head`` (with ``optimistic``): the rollout's version and
    creation time as this ledger's last write left them, and the call's intent id (None: no
    intent known), which stand in for the first read when the named parent (if any) is a tip
    this ledger wrote; the write's guard then checks them.
    ``settle_key``: the record answers a request whose earlier attempts may have failed; the
    rollout's open failed attempts noted with this retry key are cancelled in the same
    transaction, under the same lock (when the record is stored or is an identical repeat in
    an open rollout), and returned in ``Outcome.settled``."""
    e = prep.entry
    rid, cid = e.rollout_id, e.model_call_id
    decision = prep.decision
    named = decision.parent_call_id if decision is not None else None
    guard: tuple[Any, ...] = ()
    rows: Sequence[Any]
    known = None if head is None or not optimistic else _known_parent(prep, named)
    if known is not None and head is not None:
        # The rollout's head as this ledger's last write left it, the call's intent as this
        # ledger registered it, the named parent as this ledger wrote it: no read at all.
        version, created, call_pk = head
        rows = [("open", version, call_pk, "intent" if call_pk else None, None, *known)]
        guard = (rid, version, created)
    elif optimistic:
        rows = yield ("rollout_and_call", (cid, named, rid))
        if not rows or rows[0][0] != "open" or rows[0][3] == "captured":
            return NEED_LOCK  # a new rollout, a repeat or a refusal: decided under the lock
        guard = (rid, int(rows[0][1]), rows[0][9])
    else:
        locked = yield ("rollout_lock", (rid,))
        rows = (yield ("rollout_and_call", (cid, named, rid))) if locked else []
        if not rows:  # no rollout row yet: create it, then lock it before reading the call
            yield ("rollout_create", (rid, False, now, now))
            yield ("rollout_lock", (rid,))
            rows = yield ("rollout_and_call", (cid, named, rid))
    state, version, call_pk, status, stored_digest = rows[0][:5]
    recorded = None if rows[0][5] is None else rows[0][5:9]
    if state != "retired" and call_pk is not None and status == "captured":
        if stored_digest == prep.digest:
            settled = None
            if settle_key is not None and state == "open":
                settled = yield from settle_failed(rid, settle_key)
            return Outcome("duplicate", int(version), settled=settled)
        if state == "open":
            detail = f"model call id {cid!r} was reused with a different payload"
            yield ("incomplete_insert", (rid, cid, "conflicting_payload", detail[:4000], now))
            rows = yield ("bump_incomplete", (now, True, rid))
            # Commit the incomplete mark, then refuse: the first record stays.
            return Outcome(
                "refused",
                int(rows[0][0]),
                deferred=PayloadConflict(
                    f"model call id {cid!r} was reused with a different payload for rollout "
                    f"{rid!r}; the first record is kept and the rollout is marked incomplete",
                    rollout_id=rid,
                ),
            )
    refuse_if_closed(rid, state, f"record for call {cid!r}")

    plen, glen = len(prep.prompt) // 4, len(prep.generation) // 4
    parent = yield from parent_for(prep, rid, plen, recorded)
    if parent is not None and parent.method == "token_prefix" and prep.extra.get("prefix_supplied"):
        # Proven by tokens like any edge; the label says the proxy supplied the prefix.
        parent = dataclasses.replace(parent, method="supplied_prefix")
    stored_prompt, is_delta = prep.prompt, False
    if parent is not None and delta_records:
        stored_prompt, is_delta = prep.prompt[parent.cumulative_len * 4 :], True
    values = (
        e.model,
        route,
        e.response_id,
        e.schema_version,
        prep.digest,
        e.created_at,
        now,
        plen,
        glen,
        plen + glen,
        prep.prompt_digest,
        prep.cumulative_digest,
        parent.model_call_id if parent else None,
        is_delta,
        _json(e.output_items),
        e.token_item_index,
        _json(prep.extra or None),
        request_fingerprint or None,
        continuation_fingerprint or None,
    )
    ids_codec, prompt_blob, generation_blob = prep.stored_ids(stored_prompt)
    tokens = (
        ids_codec,
        prep.lp_codec,
        len(stored_prompt) // 4,
        glen,
        prompt_blob,
        generation_blob,
        prep.log_probs,
        _json(e.routed_experts),
    )
    if optimistic:
        # Anything beyond the one write (a drifted edge) is decided under the lock.
        if _unproven_recorded_parent(prep, parent) is not None:
            return NEED_LOCK
        if request_fingerprint:
            rows = yield ("conversation_parent", (rid, request_fingerprint, call_pk or 0))
            if rows and not _continues(rows[0], parent):
                return NEED_LOCK
    if folded or optimistic:
        edge = (
            rid,
            parent.pk if parent else None,
            parent.method if parent else None,
            parent.cumulative_len if parent else None,
            now,
            parent is not None,
        )
        settle = (rid, settle_key, now, rid)  # settle_key None: nothing matches
        prefix = "record_insert" if call_pk is None else "record_over_intent"
        suffix = "_if" if optimistic else "_all"
        if call_pk is None:
            args = (*guard, rid, cid, now, *values, *tokens, *edge, *settle)
        else:
            args = (*guard, *values, int(call_pk), *tokens, *edge, *settle)
        rows = yield (prefix + suffix, args)
        if not rows:  # optimistic: the rollout changed since the reads
            return NEED_LOCK
        version, pk = int(rows[0][0]), int(rows[0][1])
        settled = None if settle_key is None else tuple(str(c) for c in rows[0][2])
        if optimistic:
            head_after = (version, guard[2])
            return Outcome(
                "created", version, pk, parent, is_delta, settled=settled, head=head_after
            )
        if request_fingerprint:
            yield from diagnose_drift(rid, pk, prep.prompt, parent, request_fingerprint, now)
        yield from record_parent_mismatch(rid, pk, prep, parent, now)
        return Outcome("created", version, pk, parent, is_delta, settled=settled)
    if call_pk is None:
        rows = yield ("record_insert", (rid, cid, now, *values))
        pk = int(rows[0][0])
    else:
        pk = int(call_pk)
        yield ("record_over_intent", (*values, pk))
    yield ("tokens_insert", (pk, *tokens))
    if parent is not None:
        yield (
            "edge_insert",
            (rid, pk, parent.pk, parent.method, "verified", parent.cumulative_len, None, None, now),
        )
    yield from diagnose_drift(rid, pk, prep.prompt, parent, request_fingerprint, now)
    yield from record_parent_mismatch(rid, pk, prep, parent, now)
    rows = yield ("bump", (now, rid))
    settled = None if settle_key is None else (yield from settle_failed(rid, settle_key))
    return Outcome("created", int(rows[0][0]), pk, parent, is_delta, settled=settled)


def _known_parent(prep: Prepared, named: str | None) -> tuple[Any, ...] | None:
    """The ``rollout_and_call`` columns of the recorded parent, from this ledger's own tip of
    it (all None when the decision names none); None when the tip is not at hand."""
    if named is None:
        return (None, None, None, None)
    tip = prep.base
    if tip is None or tip.model_call_id != named:
        return None
    return (tip.pk, tip.model_call_id, tip.cumulative_len, tip.digest)


def settle_steps(rollout_id: str, retry_key: str, *, folded: bool = False) -> Steps:
    """On its own: lock the rollout and, when it is open, cancel the failed attempts noted with
    ``retry_key``; returns their call ids."""
    rows = yield ("rollout_state", (rollout_id,))
    if not rows or rows[0][0] != "open":
        return ()
    return (yield from settle_failed(rollout_id, retry_key))


def settle_failed(rollout_id: str, retry_key: str) -> Steps:
    """Cancel the open failed attempts noted with ``retry_key`` (inside a transaction that
    holds the rollout's lock and found it open); returns their call ids."""
    rows = yield ("settle_failed", (rollout_id, retry_key))
    return tuple(str(r[0]) for r in rows)


def parent_for(
    prep: Prepared, rollout_id: str, prompt_len: int, recorded: Sequence[Any] | None
) -> Steps:
    """The link parent of a new record: the writer's recorded decision (NeMo Gym 0.7.0, see
    ``ledger.lineage_ingest``) proven by tokens when it recorded one, else the ledger's own
    token-prefix proof.  ``recorded``: the captured call the decision names (id, call id,
    cumulative length and digest, read with the rollout's state), or None."""
    decision = prep.decision
    if decision is None:
        return (yield from prove_parent(rollout_id, prep.hasher, prompt_len))
    if decision.status != "resolved" or decision.parent_call_id is None:
        return None  # a recorded root stays a root; unresolved is never linked
    rows = [recorded] if recorded is not None else []
    if not rows:
        # Never received: recover an unambiguous token-prefix parent, as NeMo Gym does.
        found = yield from prove_parent(rollout_id, prep.hasher, prompt_len)
        return found if found is not None and found.method == "token_prefix" else None
    pk, cid, n, digest = int(rows[0][0]), str(rows[0][1]), int(rows[0][2]), rows[0][3]
    if n <= prompt_len:
        prep.hasher.prime([n])
        if prep.hasher.digest_at(n) == digest:
            return Parent(pk, cid, n, RECORDED_PARENT_METHOD)
    return None


def _unproven_recorded_parent(prep: Prepared, parent: Parent | None) -> str | None:
    """The call the writer recorded as the parent when no parent was proven (a drifted edge
    may be owed to it); None otherwise."""
    decision = prep.decision
    if decision is None or parent is not None:
        return None
    return decision.parent_call_id


def record_parent_mismatch(
    rollout_id: str, child_pk: int, prep: Prepared, parent: Parent | None, now: Any
) -> Steps:
    """Store a drifted edge when the writer's recorded parent is not a prefix of the prompt."""
    named = _unproven_recorded_parent(prep, parent)
    if named is None:
        return None
    rows = yield ("recorded_parent", (rollout_id, named))
    if not rows:
        return None
    parent_pk, parent_cid = int(rows[0][0]), str(rows[0][1])
    chain = yield ("ancestry_to_anchor", (rollout_id, parent_cid, rollout_id))
    try:
        cumulative = _rebuild(parent_cid, chain)
    except InvalidRecord:  # the parent's own chain is broken: nothing is shared provably
        cumulative = b""
    pos = first_mismatch(prep.prompt, cumulative)
    kind = "prompt_shorter" if pos * 4 == len(prep.prompt) else "token_mismatch"
    yield (
        "edge_insert",
        (rollout_id, child_pk, parent_pk, RECORDED_PARENT_METHOD, "drifted", pos, pos, kind, now),
    )
    return None


def prove_parent(rollout_id: str, hasher: PrefixHasher, prompt_len: int) -> Steps:
    """The earlier call whose cumulative tokens are the longest prefix of the prompt.

    Candidates come longest first, a batch at a time, each with its stored cumulative digest;
    the prompt's prefix digest at each candidate length is computed on demand (from the digest
    cache's tip when the prompt extends one), and the first equal one wins.  Identical retries
    (same tokens) collapse to the smallest call id.  No token array is read except the winner's
    generation, checked byte for byte unless this ledger wrote exactly that row's tokens.
    """
    upper = prompt_len
    while True:
        rows = yield ("parent_candidates", (rollout_id, upper, CANDIDATE_BATCH))
        if not rows:
            return None
        full = len(rows) == CANDIDATE_BATCH
        if any(r[2] < hasher.base_len for r in rows):
            # Older than the tip: hash the prefixes below it in one pass, lazily.
            longer = [r for r in rows if r[2] >= hasher.base_len]
            if not any(hasher.digest_at(r[2]) == r[3] for r in longer):
                hasher.prime([r[2] for r in rows])
        for r in rows:
            n = r[2]
            if hasher.digest_at(n) != r[3]:
                continue
            tied: Sequence[Any] = [x for x in rows if x[2] == n and x[3] == r[3]]
            if full and rows[-1][2] == n:
                tied = yield ("parent_ties", (rollout_id, n, r[3]))
            return (yield from _verified(hasher, tied))
        if not full:
            return None
        last = rows[-1][2]
        # Rows at the batch's shortest length may continue past the batch.
        at_last = yield ("parent_ties", (rollout_id, last, hasher.digest_at(last)))
        if at_last:
            return (yield from _verified(hasher, at_last))
        upper = last - 1


def _verified(hasher: PrefixHasher, tied: Sequence[Any]) -> Steps:
    win = tied[0]
    pk, n, glen = int(win[0]), int(win[2]), int(win[4])
    tip = hasher.base
    seen = tip is not None and tip.pk == pk and tip.digest == win[3] and tip.cumulative_len == n
    if not seen:
        rows = yield ("generation_of", (pk,))
        if not rows or hasher.packed[(n - glen) * 4 : n * 4] != codec.load_ids(
            rows[0][1], rows[0][0]
        ):
            return None
    method = "identical_retry" if len(tied) > 1 else "token_prefix"
    return Parent(pk, str(win[1]), n, method)


def diagnose_drift(
    rollout_id: str,
    child_pk: int,
    prompt: bytes,
    parent: Parent | None,
    request_fingerprint: str,
    now: Any,
) -> Steps:
    """Store a drifted edge when the conversation continues a call the tokens do not extend."""
    if not request_fingerprint:
        return None
    rows = yield ("conversation_parent", (rollout_id, request_fingerprint, child_pk))
    if not rows or _continues(rows[0], parent):
        return None
    conv_pk, conv_cid = int(rows[0][0]), str(rows[0][1])
    chain = yield ("ancestry_to_anchor", (rollout_id, conv_cid, rollout_id))
    cumulative = _rebuild(conv_cid, chain)
    pos = first_mismatch(prompt, cumulative)
    kind = "prompt_shorter" if pos * 4 == len(prompt) else "token_mismatch"
    yield (
        "edge_insert",
        (rollout_id, child_pk, conv_pk, "conversation", "drifted", pos, pos, kind, now),
    )
    return None


def _continues(conversation: Sequence[Any], parent: Parent | None) -> bool:
    """The conversation's parent (a ``conversation_parent`` row) is the token parent itself,
    or an identical retry of it: nothing drifted."""
    if parent is None:
        return False
    return int(conversation[0]) == parent.pk or parent.cumulative_len == int(conversation[2])


def _rebuild(model_call_id: str, chain: Sequence[Any]) -> bytes:
    """A call's full prompt+generation from its nearest full record, checked by digest."""
    if not chain or chain[0][1]:
        raise InvalidRecord(f"call {model_call_id!r} cannot be reconstructed: no full record")
    buf = bytearray()
    for r in chain:
        buf += codec.load_ids(r[5], r[3])
        buf += codec.load_ids(r[5], r[4])
    data = bytes(buf)
    if codec.token_digest(data) != chain[-1][2]:
        raise InvalidRecord(f"call {model_call_id!r} does not match its cumulative digest")
    return data


def first_mismatch(a: bytes, b: bytes) -> int:
    """Index of the first differing token between two packed sequences (or the shorter length)."""
    n = min(len(a), len(b)) // 4
    lo, hi = 0, n
    # Binary search on equal prefixes: bytes comparison of slices is C-fast.
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * 4] == b[: mid * 4]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --------------------------------------------------------------------------- drivers


_HELD: list[tuple[()]] = [()]


def delivery_steps(values: tuple[Any, ...]) -> Steps:
    """Postgres: a build's usual delivery row in one statement (``delivery_insert``: no
    idempotency key, no quarantines); its id, or None when the rollout has no row yet (the
    general form creates it)."""
    rows = yield ("delivery_insert", values)
    return int(rows[0][0]) if rows else None


def run_sqlite(dbapi_conn: Any, steps: Steps) -> Any:
    """Drive ``steps`` on a DB-API SQLite connection (``sqlite3`` or SQLAlchemy's aiosqlite
    adapter), inside the caller's transaction."""
    cur = dbapi_conn.cursor()
    try:
        step = next(steps)
        while True:
            name, params = step
            sql = STATEMENTS[name].sqlite
            if sql:
                for observe in OBSERVERS:
                    observe(sql)
                cur.execute(sql, params)
                step = steps.send(cur.fetchall())
            else:  # a Postgres-only lock: SQLite's transaction already holds the write lock
                step = steps.send(_HELD)
    except StopIteration as done:
        return done.value
    finally:
        cur.close()


async def run_postgres(conn: Any, steps: Steps) -> Any:
    """Drive ``steps`` on an asyncpg connection, inside the caller's transaction (each statement
    prepared once per connection by asyncpg's statement cache)."""
    try:
        step = next(steps)
        while True:
            name, params = step
            sql = STATEMENTS[name].postgresql
            for observe in OBSERVERS:
                observe(sql)
            rows = await conn.fetch(sql, *params)
            step = steps.send(rows)
    except StopIteration as done:
        return done.value
