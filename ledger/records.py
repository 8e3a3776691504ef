"""The call record: NeMo Gym 0.7.0's schema-version-1 ``TokenEntry``.

The fields, their defaults and the validation rules are those of the released
``nemo_gym.token_id_capture.records.TokenEntry``, so an entry dumps to the same JSON as the
release's and the release's builder reads what the ledger returns.  That includes the lineage
fields Gym's ``commit_entry`` writes in the same ``put`` (``parent_call_id``, ``cum_len``,
``digest``, ``parent_resolution`` and its reason), the continuation stamp
(``continuation_fingerprint``, ``continuation_context_len``/``_digest``,
``fingerprint_version``), ``prompt_is_delta`` and the prefix-supply flags.

Extra fields are kept (and stored), which is why newer schema versions are refused: a reader must
not silently drop fields whose meaning it does not know.

``coerce_entry`` accepts the ledger's own ``TokenEntry``, a dict, or any object carrying the
schema-1 fields (the release's pydantic ``TokenEntry`` above all: Gym's model server hands a sink
exactly those).

The ledger's own limits on top of the release's rules: rollout and call ids must match
``ledger.ids`` (the release validates rollout ids only in its file store), token ids must fit in
int32 (they are stored packed), and NaN log-probs are refused at ``put`` (the release stores them
and then fails to read the record back).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ledger import codec
from ledger.errors import InvalidRecord, UnsupportedSchemaVersion
from ledger.ids import validate_call_id, validate_rollout_id
from ledger.token_rules import check_created_at, check_log_probs, check_token_ids

__all__ = [
    "GYM_LINEAGE_DEFAULTS",
    "SCHEMA_VERSION",
    "ParentResolutionStatus",
    "TokenEntry",
    "canonical_metadata",
    "coerce_entry",
    "cumulative_tokens",
    "gym_packed_digest",
    "gym_token_digest",
    "gym_wide_digest",
    "gym_widen",
    "payload_digest",
]

SCHEMA_VERSION = 1
_TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
# NeMo Gym's token digest (``records.compute_digest``, digest version 1): SHA-256 over the domain,
# a one-byte version, an 8-byte big-endian length and each id as an 8-byte big-endian integer.
_GYM_DIGEST_DOMAIN = b"nemo-gym-tokens"
_GYM_DIGEST_VERSION = 1


class ParentResolutionStatus(StrEnum):
    """The request-time parent decision recorded on an entry (0.7.0's values)."""

    ROOT = "root"
    RESOLVED = "resolved"
    UNRESOLVED = "unresolved"


# The 0.7.0 lineage fields and their defaults.  The calls table has no column for them: a record
# keeps the non-default ones with its extra fields, and they come back on every read.
GYM_LINEAGE_DEFAULTS: dict[str, Any] = {
    "parent_call_id": None,
    "cum_len": None,
    "digest": None,
    "parent_resolution": None,
    "parent_resolution_reason": "",
    "continuation_fingerprint": "",
    "continuation_context_len": 0,
    "continuation_context_digest": "",
    "fingerprint_version": None,
    "prompt_is_delta": False,
    "prefix_requested": False,
    "prefix_supplied": False,
}


class TokenEntry(BaseModel):
    """One captured model call: the exact prompt and sampled tokens with their log-probs."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="strings")

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: Any = None
    output_items: list[dict[str, Any]] = Field(default_factory=list)
    token_item_index: int | None = None
    created_at: float = 0.0
    response_id: str | None = None
    # 0.7.0 lineage, written by Gym's ``commit_entry`` in the same put (see the module docstring).
    parent_call_id: str | None = None
    cum_len: int | None = None
    digest: str | None = None
    parent_resolution: ParentResolutionStatus | None = None
    parent_resolution_reason: str = ""
    continuation_fingerprint: str = ""
    continuation_context_len: int = 0
    continuation_context_digest: str = ""
    fingerprint_version: int | None = None
    prompt_is_delta: bool = False
    prefix_requested: bool = False
    prefix_supplied: bool = False
    # Packed ids from validation: field name -> (the list packed, its length, the bytes).  A
    # plain default, set by ``_shape``: pydantic inspects a default factory's signature for
    # every instance (about a twelfth of a Gym record's validation).
    _packed: dict[str, tuple[list[int], int, bytes]] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _gate_schema_version(cls, data: Any) -> Any:
        if isinstance(data, dict):
            version = data.get("schema_version", SCHEMA_VERSION)
            if isinstance(version, int) and not isinstance(version, bool):
                if version > SCHEMA_VERSION:
                    raise ValueError(
                        f"record schema_version {version} is newer than this reader understands "
                        f"(up to {SCHEMA_VERSION}); upgrade rollout-ledger to read it"
                    )
                if version < 1:
                    raise ValueError(f"record schema_version must be >= 1; got {version}")
        return data

    @field_validator("rollout_id")
    @classmethod
    def _rollout_id(cls, v: str) -> str:
        return validate_rollout_id(v)

    @field_validator("model_call_id")
    @classmethod
    def _call_id(cls, v: str) -> str:
        return validate_call_id(v)

    # Instead of pydantic's lax list[int] validation (which would turn true into 1 and "7" into
    # 7, and costs a Python int check per token): the same rules as the proxy's extractor
    # (ledger.token_rules) in one C pass, the int32 bound being the packing in ``_shape``.
    @field_validator("prompt_token_ids", "generation_token_ids", mode="wrap")
    @classmethod
    def _token_ids(cls, v: Any, _handler: Any, info: ValidationInfo) -> Any:
        return check_token_ids(v, str(info.field_name), packed_next=True)

    @field_validator("generation_log_probs", mode="before")
    @classmethod
    def _log_probs(cls, v: Any) -> Any:
        return check_log_probs(v, "generation_log_probs")

    @field_validator("created_at", mode="before")
    @classmethod
    def _created_at(cls, v: Any) -> Any:
        return check_created_at(v)

    @model_validator(mode="after")
    def _shape(self) -> TokenEntry:
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError(
                "generation_token_ids and generation_log_probs must have the same length; got "
                f"{len(self.generation_token_ids)} and {len(self.generation_log_probs)}"
            )
        if self.token_item_index is not None and not (
            0 <= self.token_item_index < len(self.output_items)
        ):
            raise ValueError(
                f"token_item_index {self.token_item_index} is out of range for "
                f"{len(self.output_items)} output_items"
            )
        packed = {}
        for name in ("prompt_token_ids", "generation_token_ids"):
            ids = getattr(self, name)
            # The codec's int32 packing is the range check (one C pass instead of min + max);
            # the packed bytes are kept for the ledger, which would otherwise pack them again.
            try:
                packed[name] = (ids, len(ids), codec.pack_ids(ids))
            except InvalidRecord:
                check_token_ids(ids, name)  # raises, naming the first id out of range
                raise
        self._packed = packed
        self._check_lineage()
        return self

    def _check_lineage(self) -> None:
        """The release's rules for the recorded parent decision."""
        resolution = self.parent_resolution
        if resolution == ParentResolutionStatus.RESOLVED and not self.parent_call_id:
            raise ValueError("a resolved parent_resolution requires parent_call_id")
        # A root or unresolved decision names no parent.
        rooted = resolution is not None and resolution != ParentResolutionStatus.RESOLVED
        if rooted and self.parent_call_id is not None:
            assert resolution is not None
            raise ValueError(f"a {resolution.value} parent_resolution cannot carry parent_call_id")
        if self.prompt_is_delta and (
            self.parent_call_id is None or resolution != ParentResolutionStatus.RESOLVED
        ):
            raise ValueError(
                "prompt_is_delta requires a resolved parent_call_id to reconstruct the prompt from"
            )

    def packed_ids(self, name: str) -> bytes:
        """``name``'s ids packed as int32 little-endian: the bytes packed while validating, as
        long as the field still holds that same list (assigning a new list repacks)."""
        ids = getattr(self, name)
        # The private attribute read from its dict: pydantic's attribute path for it costs
        # about 5 us, twice per record on the hot path.
        private = self.__pydantic_private__
        packed: dict[str, tuple[list[int], int, bytes]] | None = (
            private.get("_packed") if private else None
        )
        kept = packed.get(name) if packed else None
        if kept is not None and kept[0] is ids and kept[1] == len(ids):
            return kept[2]
        return codec.pack_ids(ids)

    def extra_fields(self) -> dict[str, Any]:
        """The fields the calls table has no column for: unknown extras and the 0.7.0 lineage
        fields that differ from their defaults (JSON-ready)."""
        out = {
            name: (value.value if isinstance(value, StrEnum) else value)
            for name, default in GYM_LINEAGE_DEFAULTS.items()
            if (value := getattr(self, name)) != default
        }
        out.update(self.__pydantic_extra__ or {})
        return out


def coerce_entry(entry: Any) -> TokenEntry:
    """The ledger's ``TokenEntry`` for ``entry``, validated, with the ledger's own errors.

    ``entry`` is a ``TokenEntry`` (passed through), a mapping, or any object with the schema-1
    fields: a pydantic model (the release's ``TokenEntry``) is read through its field values
    (``model_dump`` in Python mode when those do not validate as they are; floats stay exact,
    ``-inf`` included either way), other objects attribute by attribute.
    """
    if isinstance(entry, TokenEntry):
        return entry
    fields = _model_fields(entry)
    if fields is not None:
        # A pydantic model's field values as they stand (no ``model_dump`` copy of every list):
        # validated the same way; should they not validate as they are (a nested model where
        # the schema has a dict), the dumped form decides, with its own error.
        try:
            return TokenEntry.model_validate(fields)
        except ValidationError:
            pass
    try:
        return TokenEntry.model_validate(_as_mapping(entry))
    except ValidationError as exc:
        if "newer than this reader" in str(exc):
            raise UnsupportedSchemaVersion(_first_error(exc)) from None
        raise InvalidRecord(_first_error(exc)) from None


_SCHEMA_FIELDS = (*TokenEntry.model_fields,)


def _model_fields(entry: Any) -> dict[str, Any] | None:
    """A pydantic v2 model's field values and extras (its ``__dict__``), or None."""
    if getattr(type(entry), "__pydantic_fields__", None) is None:
        return None
    values = getattr(entry, "__dict__", None)
    if not isinstance(values, dict):
        return None
    extra = getattr(entry, "__pydantic_extra__", None)
    return {**values, **extra} if isinstance(extra, dict) and extra else dict(values)


def _as_mapping(entry: Any) -> Mapping[str, Any]:
    if isinstance(entry, Mapping):
        return entry
    dump = getattr(entry, "model_dump", None)
    if callable(dump):
        data = dump()
        if isinstance(data, Mapping):
            return data
    if all(hasattr(entry, name) for name in ("rollout_id", "model_call_id", "prompt_token_ids")):
        data = {name: getattr(entry, name) for name in _SCHEMA_FIELDS if hasattr(entry, name)}
        extra = getattr(entry, "__pydantic_extra__", None) or {}
        data.update(extra if isinstance(extra, Mapping) else {})
        return data
    raise InvalidRecord(
        "invalid token record: expected a TokenEntry, a dict or an object with the schema-1 "
        f"fields; got {type(entry).__name__}"
    )


def gym_token_digest(token_ids: Sequence[int]) -> str:
    """NeMo Gym 0.7.0's ``compute_digest`` of a token sequence (what ``digest`` holds): SHA-256
    over the domain ``nemo-gym-tokens``, a version byte, the length as 8 bytes big-endian, then
    every id as 8 bytes big-endian unsigned (negative ids raise ``ValueError``)."""
    h = hashlib.sha256(_GYM_DIGEST_DOMAIN)
    if not token_ids:
        return h.hexdigest()
    h.update(struct.pack(">BQ", _GYM_DIGEST_VERSION, len(token_ids)))
    try:
        h.update(struct.pack(f">{len(token_ids)}Q", *token_ids))
    except struct.error:
        raise ValueError("token ids must be non-negative for the Gym digest") from None
    return h.hexdigest()


def gym_packed_digest(packed: bytes) -> str:
    """:func:`gym_token_digest` of ids packed as the codec packs them (int32 little-endian,
    every id non-negative: validated ids are), without a Python int per token."""
    return gym_wide_digest(gym_widen(packed))


def gym_widen(packed: bytes) -> bytearray:
    """Packed ids as the Gym digest hashes them, 8 bytes big-endian each: every id's four bytes,
    reversed, become the low half of its word (strided C copies).  Widening is per id, so the
    widened form of a sequence is the widened forms of its parts, end to end: a continuation
    widens only its new tokens."""
    wide = bytearray(2 * len(packed))
    for k in range(4):
        wide[4 + k :: 8] = packed[3 - k :: 4]
    return wide


def gym_wide_digest(*parts: bytes | bytearray | memoryview) -> str:
    """The Gym digest of a widened sequence (:func:`gym_widen`), given as ``parts`` end to end
    (so a parent's widened tokens and a call's new ones need not be joined first).  Its length
    comes first in the hashed bytes, so the digest of a sequence never extends its prefix's:
    each one hashes the whole sequence."""
    n = sum(len(part) for part in parts) // 8
    h = hashlib.sha256(_GYM_DIGEST_DOMAIN)
    if n:
        h.update(struct.pack(">BQ", _GYM_DIGEST_VERSION, n))
        for part in parts:
            h.update(part)
    return h.hexdigest()


def cumulative_tokens(entry: TokenEntry) -> list[int]:
    """Prompt + generation of a full-prompt entry (a delta entry needs its parent chain)."""
    if entry.prompt_is_delta:
        raise ValueError(
            f"model call {entry.model_call_id} stores a delta prompt; reconstruct it through "
            "its parent chain"
        )
    return [*entry.prompt_token_ids, *entry.generation_token_ids]


def _first_error(exc: ValidationError) -> str:
    errs = exc.errors(include_url=False)
    parts = []
    for e in errs[:3]:
        loc = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "invalid token record: " + "; ".join(parts)


def canonical_metadata(entry: TokenEntry) -> bytes:
    """Sorted, compact JSON of every field except the token arrays."""
    data = entry.model_dump(exclude=set(_TOKEN_FIELDS))
    return orjson.dumps(data, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def payload_digest(entry: TokenEntry, prompt_digest: str, generation_packed: bytes) -> str:
    """SHA-256 identifying the record's exact content, for idempotent re-puts.

    Covers the canonical metadata, the prompt (through its token digest, so the prompt is
    hashed once per record), the generated ids and the log-probs bit-for-bit (as float64).
    """
    h = hashlib.sha256(canonical_metadata(entry))
    h.update(prompt_digest.encode())
    h.update(len(generation_packed).to_bytes(8, "little"))
    h.update(generation_packed)
    h.update(array("d", entry.generation_log_probs).tobytes())
    return h.hexdigest()
