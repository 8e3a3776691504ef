"""The read side of lineage: the proven parent of a prompt (digest walk + byte check), the
recursive ancestry query, cumulative tokens and the prefix-supply continuation lookup."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from ledger import codec
from ledger.errors import (
    InvalidRecord,
)
from ledger.ids import validate_call_id, validate_rollout_id
from ledger.storage import queries
from ledger.storage.core import LedgerCore
from ledger.storage.results import (
    ContinuationCandidate,
    LineageResolution,
)


@dataclass(frozen=True, slots=True)
class _Parent:
    pk: int
    model_call_id: str
    cumulative_len: int
    method: str


class LineageOps(LedgerCore):
    """Lineage reads (a mixin of ``Ledger``)."""

    _LENGTH_BATCH = 16

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
                conn.execute(
                    queries.parent_candidate_lengths(rollout_id, upper, self._LENGTH_BATCH)
                )
                .scalars()
                .all()
            )
            if not lengths:
                return None
            digests = codec.prefix_digests(prompt, lengths)
            rows = conn.execute(queries.parent_candidates_matching(rollout_id, digests)).all()
            if rows:
                best = rows[0].cumulative_len
                tied = [r for r in rows if r.cumulative_len == best]
                return self._verified(conn, prompt, tied)
            upper = min(lengths) - 1

    def _verified(self, conn: Connection, prompt: bytes, tied: Sequence[Any]) -> _Parent | None:
        """Check the winner's sampled tokens byte-for-byte (the digest covers the rest)."""
        win = tied[0]
        best = win.cumulative_len
        row = conn.execute(queries.generation_ids(win.id)).one_or_none()
        if row is None:
            return None
        gen = codec.load_ids(row.ids_codec, row.generation_ids)
        if prompt[(best - win.generation_len) * 4 : best * 4] != gen:
            return None
        method = "identical_retry" if len(tied) > 1 else "token_prefix"
        return _Parent(win.id, win.model_call_id, best, method)

    async def _read_cumulative_bytes(self, rollout_id: str, model_call_id: str) -> bytes:
        """``_cumulative_bytes`` in a read transaction of its own."""
        async with self._read() as aconn:
            return await aconn.run_sync(self._cumulative_bytes, rollout_id, model_call_id)

    def _cumulative_bytes(self, conn: Connection, rollout_id: str, model_call_id: str) -> bytes:
        """A call's full prompt+generation, rebuilt from its nearest full record and checked."""
        rows = conn.execute(queries.ancestry_to_anchor(rollout_id, model_call_id)).all()
        if not rows or rows[0].prompt_is_delta:
            raise InvalidRecord(f"call {model_call_id!r} cannot be reconstructed: no full record")
        buf = bytearray()
        for r in rows:
            buf += codec.load_ids(r.ids_codec, r.prompt_ids)
            buf += codec.load_ids(r.ids_codec, r.generation_ids)
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
            state = conn.execute(queries.rollout_state(rollout_id)).scalar_one_or_none()
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
        async with self._read() as conn:
            rows = (
                await conn.execute(queries.continuation_candidates(rollout_id, fingerprint))
            ).all()
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
