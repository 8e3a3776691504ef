"""Token codec: packed little-endian arrays and token-sequence digests.

Ids are int32; log-probs are float32 when every value survives the round trip through float32
bit-exactly (what vLLM's samplers produce), float64 otherwise.  Decoding gives back exactly the
Python values that were encoded, ``-9999.0`` and ``-inf`` included; NaN is refused.

The token digest is SHA-256 over a domain tag and the int32-LE bytes, with no length header, so a
single pass over a prompt yields the digest of every prefix (``prefix_digests``): that is what lets
the ledger test lineage candidates by (length, digest) in SQL without loading their tokens.
"""

from __future__ import annotations

import hashlib
import math
import sys
from array import array
from collections.abc import Iterable, Sequence

from ledger.errors import InvalidRecord

__all__ = [
    "IDS_TAG",
    "LOGPROB_F32",
    "LOGPROB_F64",
    "RunningDigest",
    "digest_state",
    "pack_ids",
    "pack_log_probs",
    "prefix_digests",
    "token_digest",
    "unpack_ids",
    "unpack_log_probs",
]

IDS_TAG = "i4le"
LOGPROB_F32 = "f4le"
LOGPROB_F64 = "f8le"
_DOMAIN = b"rollout-ledger/tokens/v1\x00"
_BIG_ENDIAN = sys.byteorder == "big"


def _to_le(arr: array) -> bytes:  # type: ignore[type-arg]
    if _BIG_ENDIAN:
        arr = array(arr.typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def _from_le(typecode: str, data: bytes) -> array:  # type: ignore[type-arg]
    arr = array(typecode)
    arr.frombytes(data)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr


def pack_ids(ids: Sequence[int]) -> bytes:
    """Pack token ids as int32 little-endian; ids outside the int32 range are refused."""
    try:
        return _to_le(array("i", ids))
    except OverflowError:
        bad = next(i for i in ids if not -(2**31) <= i < 2**31)
        raise InvalidRecord(f"token id {bad} is outside the int32 range") from None
    except TypeError as exc:
        raise InvalidRecord(f"token ids must be integers: {exc}") from None


def unpack_ids(data: bytes) -> list[int]:
    return _from_le("i", data).tolist()


def pack_log_probs(values: Sequence[float]) -> tuple[str, bytes]:
    """Pack log-probs in the narrowest float width that round-trips every value exactly."""
    try:
        f64 = array("d", values)
    except TypeError as exc:
        raise InvalidRecord(f"log-probs must be numbers: {exc}") from None
    if any(math.isnan(v) for v in f64):
        raise InvalidRecord("log-probs must not be NaN")
    f32 = array("f", f64)
    if f32.tolist() == f64.tolist():  # float32 keeps the sign of zero and infinities
        return LOGPROB_F32, _to_le(f32)
    return LOGPROB_F64, _to_le(f64)


def unpack_log_probs(tag: str, data: bytes) -> list[float]:
    if tag == LOGPROB_F32:
        return _from_le("f", data).tolist()
    if tag == LOGPROB_F64:
        return _from_le("d", data).tolist()
    raise InvalidRecord(f"unknown log-prob codec {tag!r}")


def token_digest(ids: Sequence[int] | bytes) -> str:
    """Hex SHA-256 of a token sequence (``ids`` may already be packed)."""
    data = ids if isinstance(ids, bytes) else pack_ids(ids)
    return hashlib.sha256(_DOMAIN + data).hexdigest()


def digest_state() -> hashlib._Hash:
    """A fresh token-digest state (SHA-256 seeded with the domain tag); ``.copy()`` it to extend a
    known prefix's digest with only the tokens that follow it."""
    return hashlib.sha256(_DOMAIN)


def prefix_digests(packed: bytes, lengths: Iterable[int]) -> dict[int, str]:
    """Digests of the first ``n`` tokens of ``packed`` for each ``n`` in ``lengths`` (one pass)."""
    out: dict[int, str] = {}
    h = hashlib.sha256(_DOMAIN)
    done = 0
    for n in sorted(set(lengths)):
        if n < 0 or n * 4 > len(packed):
            continue
        h.update(memoryview(packed)[done * 4 : n * 4])
        done = n
        out[n] = h.copy().hexdigest()
    return out


class RunningDigest:
    """Digest of a growing token sequence: ``hexdigest()`` after each ``update`` costs O(1)
    re-hashing, so replaying a chain checks every link's cumulative digest in one pass."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(_DOMAIN)

    def update(self, packed: bytes) -> None:
        self._h.update(packed)

    def hexdigest(self) -> str:
        return self._h.copy().hexdigest()
