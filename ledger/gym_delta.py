"""NeMo Gym 0.7.0 delta records made whole before ingest (``Ledger.put`` calls this).

A Gym delta record (``prompt_is_delta``) carries only the prompt suffix after its resolved
parent.  ``materialize_delta`` gives it its full prompt (the parent's stored cumulative tokens
plus the suffix), so the ledger's token-prefix proof at ingest sees the real prompt.  The parent
plus the suffix must reproduce the record's ``cum_len`` and ``digest``; otherwise the record is
refused.

The parent's tokens come from a reader the caller hands in (the ledger's own delta-chain
rebuild, in one read transaction), so this module imports nothing of the storage module that
calls it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ledger import codec
from ledger.errors import InvalidRecord, LedgerError
from ledger.records import TokenEntry, gym_token_digest

__all__ = ["CumulativeReader", "materialize_delta"]

CumulativeReader = Callable[[str, str], Awaitable[bytes]]
"""``(rollout_id, model_call_id)`` → that call's packed prompt+generation ids, as stored."""


async def materialize_delta(entry: TokenEntry, read_cumulative: CumulativeReader) -> TokenEntry:
    """``entry`` with its full prompt (its resolved parent's cumulative tokens + its suffix)."""
    parent = entry.parent_call_id
    if not entry.prompt_is_delta or parent is None:
        return entry
    rid = entry.rollout_id
    try:
        base = codec.unpack_ids(await read_cumulative(rid, parent))
    except LedgerError as exc:
        raise InvalidRecord(
            f"delta record {entry.model_call_id!r} cannot be reconstructed through its parent "
            f"{parent!r}: {exc}",
            rollout_id=rid,
        ) from None
    prompt = [*base, *entry.prompt_token_ids]
    full = [*prompt, *entry.generation_token_ids]
    if (entry.cum_len is not None and entry.cum_len != len(full)) or (
        entry.digest and gym_token_digest(full) != entry.digest
    ):
        raise InvalidRecord(
            f"delta record {entry.model_call_id!r}: its parent {parent!r} plus its suffix do not "
            "reproduce its cum_len/digest",
            rollout_id=rid,
        )
    return entry.model_copy(update={"prompt_token_ids": prompt})
