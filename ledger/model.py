"""Plain in-process types shared by the storage layer, the builder and the projection.

These are dataclasses, not Pydantic models: they never cross a process boundary, and the
builder works on thousands of them per rollout.  Digests are lowercase hex SHA-256 strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class CallView:
    """What the builder knows about one captured call: metadata only, never token arrays.

    ``parent_call_id``/``edge_*`` describe the lineage edge proven at ingest (``None`` for a
    root).  ``edge_status`` is ``verified`` for token-proven parents, ``drifted`` when the
    conversation says the call continues ``parent_call_id`` but its tokens do not extend it.
    """

    model_call_id: str
    prompt_len: int
    generation_len: int
    cumulative_len: int
    cumulative_digest: str
    prompt_digest: str
    created_at: float
    parent_call_id: str | None = None
    edge_method: str | None = None
    edge_status: str | None = None
    shared_len: int | None = None
    response_id: str | None = None
    output_items: list[dict[str, Any]] = field(default_factory=list)
    token_item_index: int | None = None
    request_fingerprint: str = ""
    continuation_fingerprint: str = ""
    model: str = ""
    # Prefix supply flags of the record (None: recorded with prefix supply off).
    prefix_requested: bool | None = None
    prefix_supplied: bool | None = None


@dataclass(frozen=True, slots=True)
class ChainLinkTokens:
    """The tokens of one delivered call, read once from storage.

    ``prompt_suffix`` is the part of this call's prompt beyond its chain parent's cumulative
    tokens (the whole prompt for the chain's root): exactly the tokens that are new context.
    """

    model_call_id: str
    prompt_suffix: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    output_items: list[dict[str, Any]]
    token_item_index: int | None
    routed_experts: Any = None


@dataclass(frozen=True, slots=True)
class Quarantine:
    """A call set aside by the builder, with the reason stored for audit."""

    model_call_id: str
    reason: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class TerminalAttribution:
    """Which captured call produced the verifier-scored response, and how that was decided.

    ``method`` is one of ``explicit``, ``declared``, ``response_id``, ``content_cumulative``,
    ``content_output`` or ``none`` (NeMo Gym 0.7.0's labels); ``chain`` is ``""``, ``delivered``,
    ``broken``, ``not_captured`` or ``error``; ``reason`` keeps the abstention trail.
    """

    method: str = "none"
    call_id: str | None = None
    reason: str = ""
    chain: str = ""
    declared: bool = False

    def as_metrics(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "call_id": self.call_id,
            "reason": self.reason,
            "chain": self.chain,
        }


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """One verified chain (root first).  ``role`` is ``terminal``, ``side`` or
    ``pre_compaction``; ``label`` is ``main`` or ``branch-N``."""

    call_ids: tuple[str, ...]
    label: str
    role: str


@dataclass(slots=True)
class BuildPlan:
    """The builder's decision for one frozen snapshot, before any token is read."""

    chains: list[ChainPlan]
    delivered: ChainPlan | None
    quarantines: list[Quarantine]
    terminal: TerminalAttribution
    mask_reasons: list[str]
    metrics: dict[str, Any]
    # NeMo Gym 0.7.0 reports these lists on the build, not in the metrics block.
    unresolved_retries: list[str] = field(default_factory=list)
    unresolved_parent_calls: list[str] = field(default_factory=list)

    @property
    def masked(self) -> bool:
        return bool(self.mask_reasons)
