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
from ledger.span import Span

__all__ = ["CumulativeReader", "check_cumulative", "check_extension", "materialize_delta"]

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


def check_cumulative(entry: TokenEntry, cumulative: bytes) -> None:
    """Refuse a delta record whose reconstructed prompt + generation (packed) does not give its
    recorded ``cum_len`` and ``digest`` (the length first: it costs nothing)."""
    if entry.cum_len is not None and entry.cum_len != len(cumulative) // 4:
        _refuse(entry)
    if entry.digest and gym_wide_digest(gym_widen(cumulative)) != entry.digest:
        _refuse(entry)


def check_extension(
    entry: TokenEntry, base: Span, base_wide: Span | None, new: bytes
) -> tuple[Span, bytearray] | None:
    """:func:`check_cumulative` for a record whose cumulative tokens are ``base`` (its parent's,
    packed) followed by ``new``, without joining them: the parent's widened form
    (``base_wide``, kept with its tip) is hashed where it lies and only ``new`` is widened.

    Returns the widened base and ``new`` widened, what the record's own tip extends (None when
    the record carries no digest)."""
    if entry.cum_len is not None and entry.cum_len != (len(base) + len(new)) // 4:
        _refuse(entry)
    if not entry.digest:
        return None
    if base_wide is None or len(base_wide) != 2 * len(base):
        base_wide = Span.of(gym_widen(bytes(base.view())))
    wide_new = gym_widen(new)
    with base_wide.view() as wide_base:
        digest = gym_wide_digest(wide_base, wide_new)
    if digest != entry.digest:
        _refuse(entry)
    return base_wide, wide_new


def _refuse(entry: TokenEntry) -> None:
    raise InvalidRecord(
        f"delta record {entry.model_call_id!r}: its parent {entry.parent_call_id!r} plus its "
        "suffix do not reproduce its cum_len/digest",
        rollout_id=entry.rollout_id,
    )
