"""Token arrays on the wire of the ledger's HTTP API (server routes and ``ledger.client``).

Two encodings, chosen per request with ``token_encoding``:

* ``json`` (default): plain lists; JSON has no -inf/NaN, so non-finite log-probs travel as the
  strings ``"-Infinity"``/``"Infinity"``/``"NaN"`` (never as a lossy ``null``);
* ``packed-v1``: base64 of little-endian int32 ids and float64 log-probs, exact for every value.
"""

from __future__ import annotations

import base64
import math
from array import array
from collections.abc import Sequence
from typing import Any, Literal

from ledger import codec
from ledger.errors import InvalidInput
from ledger.records import TokenEntry

__all__ = [
    "TokenEncoding",
    "decode_record",
    "encode_entry",
    "finite_json",
    "json_float",
    "pack_b64_floats",
    "pack_b64_ids",
    "unpack_b64_floats",
    "unpack_b64_ids",
]

TokenEncoding = Literal["json", "packed-v1"]
_ID_FIELDS = ("prompt_token_ids", "generation_token_ids")
_LOGPROBS = "generation_log_probs"


def pack_b64_ids(ids: Sequence[int]) -> str:
    return base64.b64encode(codec.pack_ids(ids)).decode()


def pack_b64_floats(values: Sequence[float]) -> str:
    return base64.b64encode(array("d", values).tobytes()).decode()


def _b64(value: str, field: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise InvalidInput(f"{field}: not valid base64 for token_encoding packed-v1") from None


def unpack_b64_ids(value: str, field: str) -> list[int]:
    data = _b64(value, field)
    if len(data) % 4:
        raise InvalidInput(f"{field}: packed ids must be a multiple of 4 bytes")
    return codec.unpack_ids(data)


def unpack_b64_floats(value: str, field: str) -> list[float]:
    data = _b64(value, field)
    if len(data) % 8:
        raise InvalidInput(f"{field}: packed log-probs must be a multiple of 8 bytes")
    out = array("d")
    out.frombytes(data)
    return out.tolist()


def json_float(x: float) -> float | str:
    """JSON has no -inf: a non-finite value is written as a string, never as a lossy null."""
    if math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("-Infinity" if x < 0 else "Infinity")


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float written as a string (see ``json_float``)."""
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def encode_entry(entry: TokenEntry, encoding: TokenEncoding) -> dict[str, Any]:
    """A record as JSON-ready data, token arrays in ``encoding``."""
    data = entry.model_dump(mode="json")
    if encoding == "packed-v1":
        for name in _ID_FIELDS:
            data[name] = pack_b64_ids(getattr(entry, name))
        data[_LOGPROBS] = pack_b64_floats(entry.generation_log_probs)
    else:
        data[_LOGPROBS] = [json_float(x) for x in entry.generation_log_probs]
    return data


def decode_record(raw: dict[str, Any], encoding: TokenEncoding) -> dict[str, Any]:
    """The inverse of ``encode_entry`` (``json`` records pass through: the strings for
    non-finite log-probs are parsed by ``TokenEntry``)."""
    if encoding == "json":
        return raw
    out = dict(raw)
    for name in _ID_FIELDS:
        if isinstance(out.get(name), str):
            out[name] = unpack_b64_ids(out[name], name)
    if isinstance(out.get(_LOGPROBS), str):
        out[_LOGPROBS] = unpack_b64_floats(out[_LOGPROBS], _LOGPROBS)
    return out
