"""Every statement of the ingest hot path (and of a build's usual delivery row on Postgres),
named once, in both dialects.

Written with ``?`` placeholders (SQLite's qmark style); the Postgres text is derived with ``$n``
placeholders, plus the row lock SQLite does not need (its writes already hold the database's
write lock from ``BEGIN IMMEDIATE``).  Both drivers prepare each text once per connection
(``sqlite3``'s statement cache, asyncpg's prepared-statement cache), so a call costs only the
binding and the execution.  Columns the ORM fills with Python-side defaults (timestamps, flags)
are bound explicitly here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["STATEMENTS", "Statement"]


@dataclass(frozen=True, slots=True)
class Statement:
    """One named statement: what it does, and its text per dialect."""

    name: str
    doc: str
    sqlite: str
    postgresql: str


_PLACEHOLDER = re.compile(r"\?")


def _pg(sql: str) -> str:
    n = 0

    def number(_m: re.Match[str]) -> str:
        nonlocal n
        n += 1
        return f"${n}"

    return _PLACEHOLDER.sub(number, sql)


def _stmt(name: str, doc: str, sql: str, pg_suffix: str = "") -> Statement:
    sql = " ".join(sql.split())
    return Statement(name, doc, sql, _pg(sql) + pg_suffix)


def _pg_only(name: str, doc: str, sql: str) -> Statement:
    """A Postgres lock SQLite skips: its transaction already holds the database's write lock, so
    the SQLite driver answers it with one empty row (held)."""
    return Statement(name, doc, "", _pg(" ".join(sql.split())))


_CALL_COLUMNS = (
    "model, route, response_id, schema_version, payload_digest, created_at, recorded_at, "
    "prompt_len, generation_len, cumulative_len, prompt_digest, cumulative_digest, "
    "parent_call_id, prompt_is_delta, output_items, token_item_index, extra, "
    "request_fingerprint, continuation_fingerprint"
)
_CALL_SET = ", ".join(f"{c.strip()} = ?" for c in _CALL_COLUMNS.split(","))
_CALL_VALUES = ", ".join("?" for _ in _CALL_COLUMNS.split(","))

_ALL = [
    _stmt(
        "rollout_state",
        "The rollout's state (locked on Postgres): begin_call refuses after freeze or retire.",
        "SELECT state FROM rollouts WHERE rollout_id = ?",
        " FOR UPDATE",
    ),
    _pg_only(
        "rollout_lock",
        "Lock the rollout's row for the transaction (Postgres; READ COMMITTED then gives every "
        "later statement a snapshot taken under the lock).",
        "SELECT 1 FROM rollouts WHERE rollout_id = ? FOR UPDATE",
    ),
    _stmt(
        "rollout_and_call",
        "The rollout's state and version with the call's row, if any, and the captured call "
        "the record's recorded parent decision names, if any (NULL: none named), read under "
        "the lock in one statement (or, Postgres's optimistic record, before it: the rollout's "
        "version and creation time then guard the write).",
        """SELECT r.state, r.version, c.id, c.status, c.payload_digest,
                  p.id, p.model_call_id, p.cumulative_len, p.cumulative_digest, r.created_at
           FROM rollouts r
           LEFT JOIN calls c ON c.rollout_id = r.rollout_id AND c.model_call_id = ?
           LEFT JOIN calls p
             ON p.rollout_id = r.rollout_id AND p.model_call_id = ? AND p.status = 'captured'
           WHERE r.rollout_id = ?""",
    ),
    _stmt(
        "rollout_create",
        "Create an open rollout row (a no-op when it exists).",
        """INSERT INTO rollouts (rollout_id, state, incomplete, version, created_at, updated_at)
           VALUES (?, 'open', ?, 0, ?, ?) ON CONFLICT (rollout_id) DO NOTHING""",
    ),
    _stmt(
        "intent_insert",
        "Register a call before dispatch; returns its id, or nothing for a repeat.",
        """INSERT INTO calls (rollout_id, model_call_id, status, route, model, registered_at,
                              prompt_is_delta)
           VALUES (?, ?, 'intent', ?, ?, ?, ?)
           ON CONFLICT (rollout_id, model_call_id) DO NOTHING RETURNING id""",
    ),
    _stmt(
        "parent_candidates",
        "Captured calls of the rollout that could prefix a prompt of this length, longest first "
        "(an empty generation's cumulative tokens are its prompt: never a parent).",
        """SELECT id, model_call_id, cumulative_len, cumulative_digest, generation_len
           FROM calls
           WHERE rollout_id = ? AND status = 'captured' AND generation_len > 0
             AND cumulative_len <= ?
           ORDER BY cumulative_len DESC, model_call_id LIMIT ?""",
    ),
    _stmt(
        "parent_ties",
        "Every captured call with exactly these cumulative tokens (identical retries).",
        """SELECT id, model_call_id, cumulative_len, cumulative_digest, generation_len
           FROM calls
           WHERE rollout_id = ? AND status = 'captured' AND generation_len > 0
             AND cumulative_len = ? AND cumulative_digest = ?
           ORDER BY model_call_id""",
    ),
    _stmt(
        "recorded_parent",
        "The captured call a writer's recorded parent decision names (NeMo Gym 0.7.0 lineage).",
        """SELECT id, model_call_id, cumulative_len, cumulative_digest FROM calls
           WHERE rollout_id = ? AND model_call_id = ? AND status = 'captured'""",
    ),
    _stmt(
        "generation_of",
        "A call's generated ids (the parent's sampled tokens, checked byte for byte).",
        "SELECT generation_ids, ids_codec FROM call_tokens WHERE call_id = ?",
    ),
    _stmt(
        "record_over_intent",
        "Turn a registered intent into the captured record.",
        f"UPDATE calls SET status = 'captured', {_CALL_SET} WHERE id = ?",
    ),
    _stmt(
        "record_insert",
        "Insert a captured record that had no intent; returns its id.",
        f"""INSERT INTO calls (rollout_id, model_call_id, status, registered_at, {_CALL_COLUMNS})
            VALUES (?, ?, 'captured', ?, {_CALL_VALUES}) RETURNING id""",
    ),
    _stmt(
        "tokens_insert",
        "Store a record's packed token arrays (insert-only).",
        """INSERT INTO call_tokens (call_id, ids_codec, log_prob_codec, prompt_count,
                                    generation_count, prompt_ids, generation_ids, log_probs,
                                    routed_experts)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
    ),
    _stmt(
        "edge_insert",
        "Store a lineage edge (verified, or drifted with its first mismatch).",
        """INSERT INTO lineage_edges (rollout_id, child_id, parent_id, method, status, shared_len,
                                      mismatch_pos, mismatch_kind, created_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
    ),
    _stmt(
        "conversation_parent",
        "The earliest captured call whose output this request's conversation continues.",
        """SELECT id, model_call_id, cumulative_len, cumulative_digest FROM calls
           WHERE rollout_id = ? AND status = 'captured' AND continuation_fingerprint = ?
             AND id != ?
           ORDER BY id LIMIT 1""",
    ),
    _stmt(
        "ancestry_to_anchor",
        "A call and its verified ancestors up to the nearest full record, root first.",
        """WITH RECURSIVE chain (id, parent_call_id, prompt_is_delta, depth) AS (
             SELECT id, parent_call_id, prompt_is_delta, 0 FROM calls
             WHERE rollout_id = ? AND model_call_id = ?
             UNION ALL
             SELECT p.id, p.parent_call_id, p.prompt_is_delta, chain.depth + 1
             FROM calls p JOIN chain ON p.model_call_id = chain.parent_call_id
             WHERE p.rollout_id = ? AND chain.prompt_is_delta AND chain.depth < 1000000
           )
           SELECT c.model_call_id, c.prompt_is_delta, c.cumulative_digest, t.prompt_ids,
                  t.generation_ids, t.ids_codec
           FROM chain JOIN calls c ON c.id = chain.id JOIN call_tokens t ON t.call_id = c.id
           ORDER BY chain.depth DESC""",
    ),
    _stmt(
        "incomplete_insert",
        "Store why a rollout is incomplete.",
        """INSERT INTO incomplete_events (rollout_id, model_call_id, reason, detail, created_at)
           VALUES (?, ?, ?, ?, ?)""",
    ),
    _stmt(
        "bump",
        "Bump the rollout's version (a change a consumer must see).",
        "UPDATE rollouts SET version = version + 1, updated_at = ? WHERE rollout_id = ? "
        "RETURNING version",
    ),
    _stmt(
        "bump_incomplete",
        "Bump the rollout's version and mark it incomplete.",
        "UPDATE rollouts SET version = version + 1, updated_at = ?, incomplete = ? "
        "WHERE rollout_id = ? RETURNING version",
    ),
]

# The retry key of an open intent's failed-attempt note (``extra.failed_attempt.retry_key``),
# when it is a JSON string; NULL otherwise (SQLite: also for text that is not JSON).
_SETTLE_WHERE = "rollout_id = ? AND status = 'intent' AND extra IS NOT NULL AND {key} = ?"
_SQLITE_KEY = (
    "CASE WHEN json_valid(extra) THEN "
    "CASE WHEN json_type(extra, '$.failed_attempt.retry_key') = 'text' "
    "THEN json_extract(extra, '$.failed_attempt.retry_key') END END"
)
_PG_KEY = (
    "CASE WHEN json_typeof(extra -> 'failed_attempt' -> 'retry_key') = 'string' "
    "THEN extra -> 'failed_attempt' ->> 'retry_key' END"
)
_SETTLE = "UPDATE calls SET status = 'cancelled' WHERE {where} RETURNING model_call_id"

# Postgres only: every write of a record in one statement (one round trip instead of four).
_PG_TOKENS_EDGE_BUMP = """
    t AS (
      INSERT INTO call_tokens (call_id, ids_codec, log_prob_codec, prompt_count, generation_count,
                               prompt_ids, generation_ids, log_probs, routed_experts)
      SELECT c.id, ?::varchar, ?::varchar, ?::int, ?::int, ?::bytea, ?::bytea, ?::bytea, ?::json
      FROM c
    ),
    e AS (
      INSERT INTO lineage_edges (rollout_id, child_id, parent_id, method, status, shared_len,
                                 created_at)
      SELECT ?::varchar, c.id, ?::bigint, ?::varchar, 'verified', ?::int, ?::timestamptz
      FROM c WHERE ?::boolean
    ),
    s AS (
      UPDATE calls SET status = 'cancelled'
      WHERE rollout_id = ?::varchar AND status = 'intent' AND extra IS NOT NULL
        AND {pg_key} = ?::varchar AND id NOT IN (SELECT id FROM c) AND EXISTS (SELECT 1 FROM c)
      RETURNING model_call_id
    )
    UPDATE rollouts SET version = version + 1, updated_at = ?
    WHERE rollout_id = ? AND EXISTS (SELECT 1 FROM c)
    RETURNING version, (SELECT id FROM c), ARRAY(SELECT model_call_id FROM s)"""

# Postgres's optimistic record (read without the lock, then write in one statement): the
# rollout's row, locked by the statement, must still be open at the version and creation time
# the reads saw; a version bump comes with every change to its captured calls, so an equal
# version means the reads' decision stands.  No row back: nothing was written.
_PG_GUARD = """r AS (
      SELECT 1 FROM rollouts
      WHERE rollout_id = ? AND version = ? AND created_at = ? AND state = 'open' FOR UPDATE
    )"""

# The call's columns as typed expressions (an INSERT ... SELECT gives its parameters no type).
_CALL_CASTS = (
    "?::varchar, ?::varchar, ?::varchar, ?::int, ?::varchar, ?::float8, ?::timestamptz, "
    "?::int, ?::int, ?::int, ?::varchar, ?::varchar, ?::varchar, ?::boolean, ?::json, ?::int, "
    "?::json, ?::varchar, ?::varchar"
)

_ALL += [
    _pg_only(
        "record_over_intent_all",
        "Postgres: the record over its intent, its tokens, its verified edge (if any), the "
        "cancelling of failed attempts with the retry key (if one is given; see settle_failed) "
        "and the version bump, in one statement; returns the version, the call's id and the "
        "cancelled call ids.",
        f"WITH c AS (UPDATE calls SET status = 'captured', {_CALL_SET} WHERE id = ? RETURNING id),"
        + _PG_TOKENS_EDGE_BUMP.format(pg_key=_PG_KEY),
    ),
    _pg_only(
        "record_insert_all",
        "Postgres: a record without intent, its tokens, its verified edge (if any), the "
        "cancelling of failed attempts with the retry key (if one is given; see settle_failed) "
        "and the version bump, in one statement; returns the version, the call's id and the "
        "cancelled call ids.",
        f"""WITH c AS (
              INSERT INTO calls (rollout_id, model_call_id, status, registered_at, {_CALL_COLUMNS})
              VALUES (?, ?, 'captured', ?, {_CALL_VALUES}) RETURNING id),"""
        + _PG_TOKENS_EDGE_BUMP.format(pg_key=_PG_KEY),
    ),
    _pg_only(
        "record_over_intent_if",
        "Postgres's optimistic record over its intent: ``record_over_intent_all`` when the "
        "rollout is still open at the version and creation time its reads saw (and the call is "
        "not captured); no row: nothing written.",
        f"""WITH {_PG_GUARD},
            c AS (UPDATE calls SET status = 'captured', {_CALL_SET}
                  WHERE id = ? AND status <> 'captured' AND EXISTS (SELECT 1 FROM r)
                  RETURNING id),"""
        + _PG_TOKENS_EDGE_BUMP.format(pg_key=_PG_KEY),
    ),
    _pg_only(
        "record_insert_if",
        "Postgres's optimistic record without intent: ``record_insert_all`` when the rollout is "
        "still open at the version and creation time its reads saw and no row has the call's "
        "id; no row: nothing written.",
        f"""WITH {_PG_GUARD},
            c AS (
              INSERT INTO calls (rollout_id, model_call_id, status, registered_at, {_CALL_COLUMNS})
              SELECT ?::varchar, ?::varchar, 'captured', ?::timestamptz, {_CALL_CASTS} FROM r
              ON CONFLICT (rollout_id, model_call_id) DO NOTHING RETURNING id),"""
        + _PG_TOKENS_EDGE_BUMP.format(pg_key=_PG_KEY),
    ),
    _pg_only(
        "intent_register",
        "Postgres: lock the rollout and register the call if the rollout is open, in one "
        "statement; returns the rollout's state and the intent's id if it is new (nothing: no "
        "rollout).",
        """WITH r AS (SELECT state FROM rollouts WHERE rollout_id = ? FOR UPDATE),
           ins AS (
             INSERT INTO calls (rollout_id, model_call_id, status, route, model, registered_at,
                                prompt_is_delta)
             SELECT ?::varchar, ?::varchar, 'intent', ?::varchar, ?::varchar, ?::timestamptz, false
             FROM r WHERE r.state = 'open'
             ON CONFLICT (rollout_id, model_call_id) DO NOTHING RETURNING id)
           SELECT r.state, (SELECT id FROM ins) FROM r""",
    ),
]

_ALL += [
    _pg_only(
        "delivery_insert",
        "Postgres: a build's delivery row (no idempotency key, no quarantines) under the "
        "rollout's lock, in one statement; returns its id (nothing: no rollout row, which the "
        "general form creates).",
        """WITH r AS (SELECT 1 FROM rollouts WHERE rollout_id = ? FOR UPDATE)
           INSERT INTO deliveries (rollout_id, snapshot_id, version, outcome, mask_reasons,
                                   metrics, terminal, consumer, built_at, handed_off_at)
           SELECT ?::varchar, ?::varchar, ?::bigint, ?::varchar, ?::jsonb, ?::jsonb, ?::jsonb,
                  ?::varchar, ?::timestamptz, ?::timestamptz
           FROM r RETURNING id""",
    ),
]

_ALL += [
    Statement(
        "settle_failed",
        "Cancel the rollout's open failed attempts noted with this retry key (a successful "
        "identical retry replaced them), in the record's own transaction; returns their call "
        "ids.  Only open intents with a note are looked at (few; the (rollout, status) index).",
        _SETTLE.format(where=_SETTLE_WHERE.format(key=_SQLITE_KEY)),
        _pg(_SETTLE.format(where=_SETTLE_WHERE.format(key=_PG_KEY))),
    ),
]

STATEMENTS: dict[str, Statement] = {s.name: s for s in _ALL}
