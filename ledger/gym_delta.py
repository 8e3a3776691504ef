"""NeMo Gym 0.7.0 delta records: their full prompt, checked against their stamp.

A Gym delta record (``prompt_is_delta``) carries only the prompt suffix after its resolved
parent.  The parent's cumulative tokens plus the suffix must reproduce the record's ``cum_len``
and ``digest`` (:func:`check_cumulative`); otherwise the record is refused.  Ingest takes the
parent's packed cumulative tokens from its digest cache when this ledger wrote the parent (no
read, no token list: ``ledger.storage.ingest.prepare_delta``); otherwise ``materialize_delta``
gives the record its full prompt from the stored parent chain.

The parent's tokens come from a reader the caller hands in (the ledger's own delta-chain
rebuild, in one read transaction), so this module imports nothing of the storage module that
calls it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ledger import codec
from ledger.errors import InvalidRecord, LedgerError
from ledger.records import TokenEntry, gym_wide_digest, gym_widen

__all__ = ["CumulativeReader", "check_cumulative", "materialize_delta"]

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
    check_cumulative(
        entry,
        codec.pack_ids(prompt) + entry.packed_ids("generation_token_ids"),
    )
    return entry.model_copy(update={"prompt_token_ids": prompt})


def check_cumulative(
    entry: TokenEntry, cumulative: bytes, *, wide_prefix: bytes | bytearray | None = None
) -> bytes | bytearray | None:
    """Refuse a delta record whose reconstructed prompt + generation (packed) does not give its
    recorded ``cum_len`` and ``digest`` (the length first: it costs nothing).

    ``wide_prefix``: the widened form (``gym_widen``) of a prefix of ``cumulative`` already at
    hand (the parent's, kept with its tip), so only the rest is widened.  Returns the widened
    cumulative tokens the digest was checked on (None when the record carries no digest)."""
    if entry.cum_len is not None and entry.cum_len != len(cumulative) // 4:
        _refuse(entry)
    if not entry.digest:
        return None
    wide: bytes | bytearray
    if wide_prefix is None:
        wide = gym_widen(cumulative)
    else:
        wide = wide_prefix + gym_widen(cumulative[len(wide_prefix) // 2 :])
    if gym_wide_digest(wide) != entry.digest:
        _refuse(entry)
    return wide


def _refuse(entry: TokenEntry) -> None:
    raise InvalidRecord(
        f"delta record {entry.model_call_id!r}: its parent {entry.parent_call_id!r} plus its "
        "suffix do not reproduce its cum_len/digest",
        rollout_id=entry.rollout_id,
    )
