"""The call record: NeMo Gym's schema-version-1 ``TokenEntry``, plus ``response_id``.

Extra fields are kept (and stored), which is why newer schema versions are refused: a reader must
not silently drop fields whose meaning it does not know.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ledger.errors import InvalidRecord, UnsupportedSchemaVersion
from ledger.ids import validate_call_id, validate_rollout_id
from ledger.token_rules import check_created_at, check_log_probs, check_token_ids

__all__ = ["SCHEMA_VERSION", "TokenEntry", "canonical_metadata", "coerce_entry", "payload_digest"]

SCHEMA_VERSION = 1
_TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


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

    # Before pydantic's lax coercion (which would turn true into 1 and "7" into 7): the same
    # rules as the proxy's extractor (ledger.token_rules).
    @field_validator("prompt_token_ids", mode="before")
    @classmethod
    def _prompt_ids(cls, v: Any) -> Any:
        return check_token_ids(v, "prompt_token_ids")

    @field_validator("generation_token_ids", mode="before")
    @classmethod
    def _generation_ids(cls, v: Any) -> Any:
        return check_token_ids(v, "generation_token_ids")

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
        return self

    def extra_fields(self) -> dict[str, Any]:
        return dict(self.__pydantic_extra__ or {})


def coerce_entry(entry: TokenEntry | dict[str, Any]) -> TokenEntry:
    """Validate a dict (or pass a ``TokenEntry`` through) with the ledger's own errors."""
    if isinstance(entry, TokenEntry):
        return entry
    try:
        return TokenEntry.model_validate(entry)
    except ValidationError as exc:
        if "newer than this reader" in str(exc):
            raise UnsupportedSchemaVersion(_first_error(exc)) from None
        raise InvalidRecord(_first_error(exc)) from None


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
