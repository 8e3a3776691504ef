"""The trainer path's types: the typed ``Build`` and what a token source must offer.

A ``Build`` is what finalizing one rollout produced.  It arises in exactly one of these ways,
each with its own constructor:

- ``Build.masked_before_build``: nothing was built (no capture key, a malformed one, or the
  source failed): masked with one reason, no snapshot identity;
- ``Build.redundant``: the result already carries generated token ids (a native agent); the
  capture was frozen (late writes fenced) and its snapshot may be retired, nothing is applied;
- ``Build.built``: a frozen snapshot went through the builder: delivered, masked or failed;
- ``Build.from_wire``: a build a ledger server made (``POST /ledger/v1/finalize``), whose
  rebuilt response travels in the result, not on the build.

``Build.at_snapshot`` re-labels a build made over a scratch copy with the identity of the
source's own snapshot (``ledger.source_build``).

``to_wire()`` is the one conversion to NeMo Gym's build shape (the dict
``finalize_rollout_token_capture`` returns, the HTTP answer's ``build``): key for key what the
seed returns, ``_capture_snapshot`` and ``_redundant_capture`` included.  No module builds such
a dict by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = [
    "BUILD_OUTCOMES",
    "Build",
    "BuildOutcome",
    "BuildService",
    "SourceSnapshot",
    "TokenSource",
    "Trajectory",
]

BuildOutcome = Literal["delivered", "masked", "failed", "redundant"]
BUILD_OUTCOMES: tuple[BuildOutcome, ...] = ("delivered", "masked", "failed", "redundant")


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One emitted chain (``deliver="all-chains"``): its label, role and projected response."""

    label: str
    role: str
    response: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"label": self.label, "role": self.role, "response": self.response}


@dataclass(frozen=True, slots=True)
class Build:
    """What finalizing one rollout produced (see the module docstring for its constructors).

    ``mask_sample`` is the capture's verdict (it decides retirement); ``mask_reasons`` may also
    name the environment's own mask, which never changes that verdict.  ``metrics`` is NeMo
    Gym's ``_ng_token_capture`` block, written into the result as it is.
    """

    rollout_id: str | None
    outcome: BuildOutcome
    mask_sample: bool
    mask_reasons: tuple[str, ...]
    metrics: Mapping[str, Any]
    rebuilt_response: dict[str, Any] | None = None
    snapshot_id: str | None = None
    version: int | None = None
    delivery_id: int | None = None
    # Reported by a build that went through the builder (``None``: not part of this build).
    unresolved_retries: tuple[str, ...] | None = None
    unresolved_parent_calls: tuple[str, ...] | None = None
    trajectories: tuple[Trajectory, ...] | None = None
    redundant_capture: bool = False
    # Built on a ledger server: the rebuilt response is in the returned result, not here.
    remote: bool = False

    # ------------------------------------------------------------------ constructors

    @classmethod
    def masked_before_build(cls, rollout_id: str | None, error: str, reason: str) -> Build:
        """Nothing was built: masked with ``reason``, ``error`` in the metrics."""
        metrics = {"n_calls": 0, "error": error, "mask_reasons": [reason]}
        return cls(rollout_id, "failed", True, (reason,), metrics)

    @classmethod
    def redundant(cls, rollout_id: str, snapshot_id: str | None, version: int) -> Build:
        """The result already carries its token ids; the frozen capture is only retired."""
        return cls(
            rollout_id,
            "redundant",
            False,
            (),
            {},
            snapshot_id=snapshot_id,
            version=version,
            redundant_capture=True,
        )

    @classmethod
    def built(
        cls,
        rollout_id: str,
        *,
        failed: bool,
        mask_reasons: Sequence[str],
        metrics: Mapping[str, Any],
        rebuilt_response: dict[str, Any] | None,
        snapshot_id: str,
        version: int,
        unresolved_retries: Sequence[str],
        unresolved_parent_calls: Sequence[str],
        trajectories: Sequence[Trajectory] | None,
        delivery_id: int | None = None,
    ) -> Build:
        """A snapshot through the builder: ``failed``, else ``masked`` with reasons, else
        ``delivered``."""
        reasons = tuple(mask_reasons)
        outcome: BuildOutcome = "failed" if failed else ("masked" if reasons else "delivered")
        return cls(
            rollout_id,
            outcome,
            bool(reasons),
            reasons,
            metrics,
            rebuilt_response=rebuilt_response,
            snapshot_id=snapshot_id,
            version=version,
            delivery_id=delivery_id,
            unresolved_retries=tuple(unresolved_retries),
            unresolved_parent_calls=tuple(unresolved_parent_calls),
            trajectories=None if trajectories is None else tuple(trajectories),
        )

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], *, remote: bool = False) -> Build:
        """A build in NeMo Gym's shape (``to_wire``'s inverse); refuses an unknown outcome."""
        outcome = data.get("outcome")
        if outcome not in BUILD_OUTCOMES:
            raise ValueError(f"unknown build outcome {outcome!r}")
        trajectories = data.get("trajectories")
        version = data.get("version")
        delivery_id = data.get("delivery_id")
        return cls(
            rollout_id=data.get("rollout_id"),
            outcome=outcome,
            mask_sample=bool(data.get("mask_sample")),
            mask_reasons=tuple(data.get("mask_reasons") or ()),
            metrics=dict(data.get("metrics") or {}),
            rebuilt_response=data.get("rebuilt_response"),
            snapshot_id=data.get("snapshot_id"),
            version=None if version is None else int(version),
            delivery_id=None if delivery_id is None else int(delivery_id),
            unresolved_retries=_optional_tuple(data, "unresolved_retries"),
            unresolved_parent_calls=_optional_tuple(data, "unresolved_parent_calls"),
            trajectories=None
            if trajectories is None
            else tuple(Trajectory(t["label"], t["role"], t["response"]) for t in trajectories),
            redundant_capture=bool(data.get("_redundant_capture")),
            remote=remote,
        )

    # ------------------------------------------------------------------ derived builds

    def at_snapshot(self, snapshot_id: str, version: int) -> Build:
        """This build under another snapshot identity (the source's own), with no delivery
        row: what a build over a scratch copy of a foreign source answers."""
        return dataclasses.replace(self, snapshot_id=snapshot_id, version=version, delivery_id=None)

    def with_delivery(self, delivery_id: int) -> Build:
        return dataclasses.replace(self, delivery_id=delivery_id)

    def with_mask_reason(self, reason: str) -> Build:
        """``reason`` added to the reported mask reasons (build and metrics); the verdict
        ``mask_sample`` stays the capture's."""
        reasons = self.mask_reasons if reason in self.mask_reasons else (*self.mask_reasons, reason)
        metrics = dict(self.metrics)
        if reason not in (metrics.get("mask_reasons") or ()):
            metrics["mask_reasons"] = [*(metrics.get("mask_reasons") or ()), reason]
        return dataclasses.replace(self, mask_reasons=reasons, metrics=metrics)

    # ------------------------------------------------------------------ reading it

    @property
    def retirable(self) -> bool:
        """Delivered (or redundant), not masked, with a full snapshot identity."""
        return (
            not self.mask_sample
            and self.outcome in ("delivered", "redundant")
            and bool(self.snapshot_id)
            and self.version is not None
        )

    @property
    def terminal(self) -> Mapping[str, Any] | None:
        """The terminal attribution block of the metrics, if the builder made one."""
        terminal = self.metrics.get("terminal_attribution")
        return terminal if isinstance(terminal, Mapping) else None

    @property
    def error(self) -> str | None:
        error = self.metrics.get("error")
        return None if error is None else str(error)

    def to_wire(self, *, with_response: bool = True) -> dict[str, Any]:
        """NeMo Gym's build dict, key for key (``with_response=False``: without
        ``rebuilt_response``, as the HTTP answer carries it in the result instead)."""
        out: dict[str, Any] = {
            "rollout_id": self.rollout_id,
            "outcome": self.outcome,
            "mask_sample": self.mask_sample,
            "mask_reasons": list(self.mask_reasons),
            "metrics": self.metrics,
        }
        if with_response and not self.remote:
            out["rebuilt_response"] = self.rebuilt_response
        out["snapshot_id"] = self.snapshot_id
        out["version"] = self.version
        if self.snapshot_id is not None:
            out["_capture_snapshot"] = {"snapshot_id": self.snapshot_id, "version": self.version}
        if self.unresolved_retries is not None:
            out["unresolved_retries"] = list(self.unresolved_retries)
        if self.unresolved_parent_calls is not None:
            out["unresolved_parent_calls"] = list(self.unresolved_parent_calls)
        if self.trajectories is not None:
            out["trajectories"] = [t.to_wire() for t in self.trajectories]
        out["delivery_id"] = self.delivery_id
        if self.redundant_capture:
            out["_redundant_capture"] = True
        return out


def _optional_tuple(data: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    value = data.get(key)
    return None if value is None else tuple(str(v) for v in value)


# --------------------------------------------------------------------------- sources


@runtime_checkable
class SourceSnapshot(Protocol):
    """A frozen snapshot as any NeMo Gym ``TokenSource`` returns it."""

    @property
    def rollout_id(self) -> str: ...
    @property
    def entries(self) -> Sequence[Any]: ...
    @property
    def incomplete(self) -> bool: ...
    @property
    def snapshot_id(self) -> str: ...
    @property
    def version(self) -> int: ...


@runtime_checkable
class TokenSource(Protocol):
    """What NeMo Gym 0.7.0 promises of a token source: freeze a rollout, then drop exactly the
    consumed snapshot (the file store, a training framework's transport, ``CaptureSource``)."""

    async def freeze(self, rollout_id: str) -> SourceSnapshot: ...
    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool: ...


class BuildService(Protocol):
    """A ledger that builds on its own side (``ledger.client.RemoteLedger``): finalize there,
    acknowledge the delivery, retire by snapshot identity."""

    async def finalize(
        self, result: dict[str, Any], *, deliver: str = "one", consumer: str = ""
    ) -> Build: ...
    async def mark_delivery(
        self, delivery_id: int, *, handed_off: bool = False, durable: bool = False
    ) -> None: ...
    async def retire(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool: ...
