"""Token codec: packed little-endian arrays and token-sequence digests.

Ids are int32; log-probs are float32 when every value survives the round trip through float32
bit-exactly (what vLLM's samplers produce), float64 otherwise.  Decoding gives back exactly the
Python values that were encoded, ``-9999.0`` and ``-inf`` included; NaN is refused.

Stored arrays (``call_tokens``) name their encoding per row (``ids_codec``, ``log_prob_codec``):
the plain little-endian arrays above, or the same bytes split into byte planes (every value's
byte 0, then every byte 1, ...) and deflated, one deflate block per plane.  Token ids sit far
below 2**31 (a 151k vocabulary needs 18 bits), so their high planes are nearly constant, and so
are the sign and exponent bytes of log-probs; the low planes, near-uniform, go into the stream
as stored (copied) blocks unless a probe shows coding them pays.  Small arrays stay plain.
Every digest is defined on the plain int32 bytes, never on a stored encoding.

The token digest is SHA-256 over a domain tag and the int32-LE bytes, with no length header, so a
single pass over a prompt yields the digest of every prefix (``prefix_digests``): that is what lets
the ledger test lineage candidates by (length, digest) in SQL without loading their tokens.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from ledger.errors import InvalidRecord

__all__ = [
    "IDS_PLANES",
    "IDS_TAG",
    "LOGPROB_F32",
    "LOGPROB_F32_PLANES",
    "LOGPROB_F64",
    "LOGPROB_F64_PLANES",
    "MIN_DEFLATE_BYTES",
    "RunningDigest",
    "deflate_planes",
    "digest_state",
    "inflate_planes",
    "load_ids",
    "pack_ids",
    "pack_log_probs",
    "prefix_digests",
    "store_ids",
    "store_log_probs",
    "token_digest",
    "unpack_ids",
    "unpack_log_probs",
]

IDS_TAG = "i4le"
LOGPROB_F32 = "f4le"
LOGPROB_F64 = "f8le"
# Byte-plane deflated forms of the three (see the module docstring).
IDS_PLANES = "i4pz"
LOGPROB_F32_PLANES = "f4pz"
LOGPROB_F64_PLANES = "f8pz"
# Arrays (a row's ids together) shorter than this are stored plain: deflate's block headers
# would eat what it saves.
MIN_DEFLATE_BYTES = 64
_PLANES_OF = {LOGPROB_F32: LOGPROB_F32_PLANES, LOGPROB_F64: LOGPROB_F64_PLANES}
# A small window and hash table: planes are short and matches are rare, so deflate's setup
# (not its coding) is what a call would pay for with the defaults.
_WBITS = -12
_MEM_LEVEL = 4
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
    """Pack token ids as int32 little-endian; ids outside the int32 range are refused.

    ``struct`` packs a list in one C pass straight into little-endian bytes, about twice as fast
    as ``array("i", ids)`` on a long prompt (which converts each id, then copies the array);
    the same values are accepted (Python ``int``, bools included) and refused."""
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error:
        for bad in ids:
            if not isinstance(bad, int):
                raise InvalidRecord(
                    f"token ids must be integers: {type(bad).__name__} {bad!r} is not"
                ) from None
        bad = next(i for i in ids if not -(2**31) <= i < 2**31)
        raise InvalidRecord(f"token id {bad} is outside the int32 range") from None


def unpack_ids(data: bytes) -> list[int]:
    return _from_le("i", data).tolist()


def pack_log_probs(values: Sequence[float]) -> tuple[str, bytes]:
    """Pack log-probs in the narrowest float width that round-trips every value exactly."""
    try:
        f32 = array("f", values)
    except TypeError as exc:
        raise InvalidRecord(f"log-probs must be numbers: {exc}") from None
    # Straight from the values (converting a float64 array first costs twice as much); a NaN
    # never compares equal, so it takes the float64 path and is refused there.
    if f32.tolist() == (values if isinstance(values, list) else list(values)):
        return LOGPROB_F32, _to_le(f32)  # float32 keeps the sign of zero and infinities
    f64 = array("d", values)
    total = sum(f64)  # NaN (C-speed) when any value is NaN; the exact check only then
    if total != total and any(math.isnan(v) for v in f64):
        raise InvalidRecord("log-probs must not be NaN")
    return LOGPROB_F64, _to_le(f64)


def unpack_log_probs(tag: str, data: bytes) -> list[float]:
    if tag == LOGPROB_F32:
        return _from_le("f", data).tolist()
    if tag == LOGPROB_F64:
        return _from_le("d", data).tolist()
    if tag == LOGPROB_F32_PLANES:
        return _from_le("f", inflate_planes(bytes(data), 4)).tolist()
    if tag == LOGPROB_F64_PLANES:
        return _from_le("d", inflate_planes(bytes(data), 8)).tolist()
    raise InvalidRecord(f"unknown log-prob codec {tag!r}")


def deflate_planes(data: bytes, width: int, *, floats: bool = False) -> bytes:
    """``data`` (``width``-byte values: ids, or IEEE ``floats``) as byte planes in one
    raw-deflate stream.  The reader only inflates the stream and puts the planes back; how the
    encoder cut it into blocks is its own choice:

    * a short array (a call's prompt suffix, generation or log-probs): the planes that are
      near-uniform by their nature (an id's low half; a float's mantissa bytes) go in as stored
      blocks (a copy) and the rest in one deflated block, in one call: a compressor and code
      table per plane saved a few dozen bytes and cost more than the rest of the record's
      packing;
    * a long one: the low half of the planes is probed first, stored when coding it would not
      pay (ids of a large vocabulary: coding costs about 25 ns a byte, 1.7 ms for a 16k-token
      prompt, and saves nothing) and coded otherwise (a small vocabulary, a run of repeats);
      every higher plane is coded in a block of its own, so its own codes (``floats``:
      Huffman coding only, as matches in mantissas are chance and only cost bits)."""
    if len(data) % width:
        raise ValueError(f"{len(data)} bytes is not a whole number of {width}-byte values")
    if len(data) <= _ONE_BLOCK_BYTES:
        stored = width * 3 // 4 if floats else width // 2
        # Not ``zlib.compress``: at the default memory level it clears a 64 KiB hash table for
        # every plane, three a record.  The long path's small table codes these short planes
        # to the same bytes (the benchmark's records) in about four fifths of the time.
        short = _coder()
        coded = short.compress(b"".join([data[plane::width] for plane in range(stored, width)]))
        return _stored_blocks(b"".join([data[plane::width] for plane in range(stored)])) + (
            coded + short.flush()
        )
    strategy = zlib.Z_HUFFMAN_ONLY if floats else zlib.Z_DEFAULT_STRATEGY
    low = width // 2
    low_planes = b"".join([data[plane::width] for plane in range(low)])
    out: list[bytes] = []
    z: Any = None
    if _codes_pay(low_planes, strategy):
        z = _coder(strategy)
        out.append(z.compress(low_planes))
    else:
        out.append(_stored_blocks(low_planes))
    for plane in range(low, width):
        if z is None:
            z = _coder(strategy)
        else:
            out.append(z.flush(zlib.Z_BLOCK))
        out.append(z.compress(data[plane::width]))
    out.append(z.flush() if z is not None else _FINAL_EMPTY_BLOCK)
    return b"".join(out)


# Arrays up to this size go in one block (see ``deflate_planes``).
_ONE_BLOCK_BYTES = 16 * 1024
# The probe: this many bytes from the middle of the low planes are coded on their own; coding
# pays when they shrink below this share of their size.
_PROBE_BYTES = 2048
_PROBE_PAYS = 0.9
# A raw-deflate stored block's most bytes, and an empty final one (BFINAL=1, BTYPE=00, LEN=0).
_STORED_MAX = 65535
_FINAL_EMPTY_BLOCK = b"\x01\x00\x00\xff\xff"


def _coder(strategy: int = zlib.Z_DEFAULT_STRATEGY) -> zlib._Compress:
    """A raw-deflate compressor at level 1 with the small window and hash table (every plane
    and probe is coded with these settings; only the strategy differs)."""
    return zlib.compressobj(1, zlib.DEFLATED, _WBITS, _MEM_LEVEL, strategy)


def _codes_pay(chunk: bytes, strategy: int) -> bool:
    if len(chunk) <= 2 * _PROBE_BYTES:
        return True  # a short array: coding it all costs about what the probe would
    mid = (len(chunk) - _PROBE_BYTES) // 2
    sample = chunk[mid : mid + _PROBE_BYTES]
    probe = _coder(strategy)
    coded = len(probe.compress(sample)) + len(probe.flush())
    return coded < _PROBE_PAYS * len(sample)


def _stored_blocks(chunk: bytes) -> bytes:
    """``chunk`` as non-final raw-deflate stored blocks, starting and ending on a byte boundary
    (so a compressor's fresh stream can follow)."""
    out: list[bytes] = []
    for start in range(0, len(chunk), _STORED_MAX):
        part = chunk[start : start + _STORED_MAX]
        n = len(part)
        out.append(bytes((0, n & 0xFF, n >> 8, ~n & 0xFF, (~n >> 8) & 0xFF)))
        out.append(part)
    return b"".join(out)


def inflate_planes(data: bytes, width: int) -> bytes:
    """The inverse of :func:`deflate_planes`: the original ``width``-byte values."""
    try:
        planes = zlib.decompress(data, -15)
    except zlib.error as exc:
        raise InvalidRecord(f"stored token array does not inflate: {exc}") from None
    if len(planes) % width:
        raise InvalidRecord("stored token array inflates to a partial value")
    n = len(planes) // width
    out = bytearray(len(planes))
    for plane in range(width):
        out[plane::width] = planes[plane * n : (plane + 1) * n]
    return bytes(out)


def store_ids(prompt: bytes, generation: bytes) -> tuple[str, bytes, bytes]:
    """A row's packed prompt and generation ids as stored: ``(ids_codec, prompt, generation)``."""
    if len(prompt) + len(generation) < MIN_DEFLATE_BYTES:
        return IDS_TAG, prompt, generation
    return IDS_PLANES, deflate_planes(prompt, 4), deflate_planes(generation, 4)


def load_ids(tag: str, data: bytes) -> bytes:
    """Stored ids back to packed int32-LE bytes (what digests and comparisons see)."""
    if tag == IDS_TAG:
        return bytes(data)
    if tag == IDS_PLANES:
        return inflate_planes(bytes(data), 4)
    raise InvalidRecord(f"unknown token id codec {tag!r}")


def store_log_probs(values: Sequence[float]) -> tuple[str, bytes]:
    """Log-probs as stored: :func:`pack_log_probs`, deflated by plane when not small."""
    tag, data = pack_log_probs(values)
    if len(data) < MIN_DEFLATE_BYTES:
        return tag, data
    width = 4 if tag == LOGPROB_F32 else 8
    return _PLANES_OF[tag], deflate_planes(data, width, floats=True)


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

    def update(self, packed: bytes | memoryview) -> None:
        self._h.update(packed)

    def hexdigest(self) -> str:
        return self._h.copy().hexdigest()
