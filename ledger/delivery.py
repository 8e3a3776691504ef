"""Finalize and retire rollouts with the seed's semantics (design §5.4, §4.7, §4.8).

``finalize_rollout_token_capture(result, source)`` freezes the rollout, plans the build from
call metadata, reads the delivered chain's tokens once, projects them into ``response.output``
in place, records the build in ``deliveries`` and returns the build.  It never raises: any
failure masks the rollout with its reason.  ``retire_rollout_token_capture`` retires only a
delivered (or redundant) build, with its exact snapshot identity, and only after the caller has
written the rebuilt result durably.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from ledger.builder import failed_plan, plan_build
from ledger.errors import InvalidRolloutId, ProjectionError
from ledger.ids import rollout_id_from_run_body
from ledger.model import BuildPlan, ChainPlan
from ledger.projection import project_chain
from ledger.store import Ledger, SnapshotViews

__all__ = [
    "build_rollout",
    "finalize_rollout_token_capture",
    "retire_rollout_token_capture",
]

log = logging.getLogger("rollout_ledger.delivery")


def _backend(source: Any) -> Any:
    """Accept a ``CaptureSource``/``Ledger``/remote client; return what builds (a ``Ledger``,
    built here by ``build_rollout``, or a client with ``finalize``, ``retire``,
    ``mark_delivery``)."""
    return getattr(source, "backend", source)


def _is_ledger(source: Any) -> bool:
    """The ledger's own source (fast path), as opposed to any other Gym ``TokenSource``."""
    backend = _backend(source)
    return isinstance(backend, Ledger) or callable(getattr(backend, "finalize", None))


async def _build_at(
    backend: Any, result: dict[str, Any], *, deliver: str, consumer: str
) -> dict[str, Any]:
    """Build here over a SQL ``Ledger``; a remote ledger (``RemoteLedger``) builds on its server."""
    if isinstance(backend, Ledger):
        return await build_rollout(backend, result, deliver=deliver, consumer=consumer)
    build: dict[str, Any] = await backend.finalize(result, deliver=deliver, consumer=consumer)
    return build


def carries_token_ids(result: Mapping[str, Any]) -> bool:
    """True when the rollout's output already holds generated token ids (a native agent)."""
    response = result.get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    if not isinstance(output, list):
        return False
    return any(
        isinstance(item, Mapping) and bool(item.get("generation_token_ids")) for item in output
    )


def _masked_build(rollout_id: str | None, error: str, reason: str) -> dict[str, Any]:
    metrics = {"n_calls": 0, "error": error, "mask_reasons": [reason]}
    return {
        "rollout_id": rollout_id,
        "outcome": "failed",
        "mask_sample": True,
        "mask_reasons": [reason],
        "metrics": metrics,
        "rebuilt_response": None,
        "snapshot_id": None,
        "version": None,
        "delivery_id": None,
    }


# The mask reason reported when the environment (the verifier) had already set ``mask_sample``.
ENVIRONMENT_MASK_REASON = "environment_mask_sample"


def _keep_environment_mask(result: Mapping[str, Any], build: dict[str, Any]) -> None:
    """An environment's ``mask_sample: true`` stands whatever capture says (as in NeMo Gym):
    name it among the record's mask reasons.  The build's own verdict (``mask_sample``, which
    decides retirement) stays the capture's."""
    if not result.get("mask_sample") or _masked_by_an_earlier_build(result):
        return
    for holder in (build, build.get("metrics")):
        if isinstance(holder, dict):
            reasons = list(holder.get("mask_reasons") or [])
            if ENVIRONMENT_MASK_REASON not in reasons:
                holder["mask_reasons"] = [*reasons, ENVIRONMENT_MASK_REASON]


def _masked_by_an_earlier_build(result: Mapping[str, Any]) -> bool:
    """A result finalized before (it carries ``_ng_token_capture``) whose ``mask_sample`` was
    that build's capture verdict, not the environment's: finalizing it again must not report an
    environment mask."""
    earlier = result.get("_ng_token_capture")
    if not isinstance(earlier, Mapping):
        return False
    reasons = earlier.get("mask_reasons") or ()
    return bool(reasons) and ENVIRONMENT_MASK_REASON not in reasons


def _apply(result: dict[str, Any], build: dict[str, Any]) -> None:
    """Write the build into the rollout result (only ``output``/``usage`` of the response).

    ``mask_sample`` is only ever set, never cleared: an environment's mask stands."""
    rebuilt = build.get("rebuilt_response")
    if rebuilt is not None:
        response = result.get("response")
        if isinstance(response, dict):
            response["output"] = rebuilt["output"]
            response["usage"] = rebuilt["usage"]
        else:
            result["response"] = rebuilt
    result["_ng_token_capture"] = build["metrics"]
    if build["mask_sample"]:
        result["mask_sample"] = True


async def finalize_rollout_token_capture(
    result: dict[str, Any], source: Any, *, deliver: str = "one", consumer: str = ""
) -> dict[str, Any] | None:
    """Rebuild ``result["response"]["output"]`` in place from the captured calls.

    Returns the build (outcome, mask reasons, metrics, snapshot identity), or ``None`` when
    ``source`` is ``None``.  Never raises: a failure masks the rollout with its reason.
    """
    if source is None:
        return None
    try:
        rollout_id = rollout_id_from_run_body(result)
    except InvalidRolloutId as exc:
        build = _masked_build(None, f"malformed rollout id: {exc}", "malformed_rollout_id")
        _apply(result, build)
        return build
    if rollout_id is None:
        build = _masked_build(None, "no capture key", "no_capture_key")
        _apply(result, build)
        return build
    try:
        if _is_ledger(source):
            build = await _build_at(_backend(source), result, deliver=deliver, consumer=consumer)
        else:  # any other TokenSource: its frozen entries, through the same ingest and builder
            from ledger.source_build import build_from_source

            build = await build_from_source(
                source, result, rollout_id, build_rollout, deliver=deliver, consumer=consumer
            )
    except Exception as exc:  # the source itself failed: mask, keep everything for diagnosis
        log.warning("finalize failed for rollout %s: %s", rollout_id, exc)
        build = _masked_build(rollout_id, f"{type(exc).__name__}: {exc}", "source_error")
    if build.get("outcome") != "redundant":
        _keep_environment_mask(result, build)
        _apply(result, build)
    return build


async def retire_rollout_token_capture(
    rollout_id: str, source: Any, built: Mapping[str, Any] | None
) -> bool:
    """Retire a delivered build's records, by its exact snapshot identity.

    Call only after the rebuilt result is durably stored.  Masked and failed builds are never
    retired: their records stay for diagnosis.  Returns whether the records were retired.
    """
    if (
        not built
        or built.get("mask_sample")
        or built.get("outcome") not in ("delivered", "redundant")
    ):
        return False
    snapshot_id, version = built.get("snapshot_id"), built.get("version")
    if not snapshot_id or version is None:
        return False
    if not _is_ledger(source):  # any other TokenSource retires through its own ``drop``
        try:
            return bool(
                await source.drop(rollout_id, snapshot_id=str(snapshot_id), version=int(version))
            )
        except Exception as exc:
            log.warning("retire failed for rollout %s: %s", rollout_id, exc)
            return False
    backend = _backend(source)
    try:
        if built.get("delivery_id") is not None:
            await backend.mark_delivery(int(built["delivery_id"]), durable=True)
        return bool(
            await backend.retire(rollout_id, snapshot_id=str(snapshot_id), version=int(version))
        )
    except Exception as exc:
        log.warning("retire failed for rollout %s: %s", rollout_id, exc)
        return False


# --------------------------------------------------------------------------- the build itself


async def build_rollout(
    ledger: Ledger, result: dict[str, Any], *, deliver: str = "one", consumer: str = ""
) -> dict[str, Any]:
    """Freeze, plan, read the delivered chain once, project, and record the delivery row.

    ``result`` is only read here; ``finalize_rollout_token_capture`` applies the build.
    """
    rollout_id = rollout_id_from_run_body(result)
    if rollout_id is None:
        return _masked_build(None, "no capture key", "no_capture_key")
    if carries_token_ids(result):
        state = await ledger.freeze_state(rollout_id)  # fence late writes all the same
        return {
            "rollout_id": rollout_id,
            "outcome": "redundant",
            "mask_sample": False,
            "mask_reasons": [],
            "metrics": {},
            "rebuilt_response": None,
            "snapshot_id": state.snapshot_id,
            "version": state.version,
            "_capture_snapshot": {"snapshot_id": state.snapshot_id, "version": state.version},
            "delivery_id": None,
            "_redundant_capture": True,
        }
    views = await ledger.freeze_views(rollout_id)
    try:
        plan = plan_build(
            views.calls,
            n_calls=views.n_calls,
            incomplete=views.incomplete,
            result=result,
            deliver=deliver,
        )
    except ValueError as exc:  # contradictory metadata: record the failure, never guess
        error = f"{type(exc).__name__}: {exc}"
        plan = failed_plan(n_calls=views.n_calls, incomplete=views.incomplete, error=error)
    build = await _execute(ledger, rollout_id, views, plan, result, deliver)
    build["delivery_id"] = await ledger.record_delivery(
        rollout_id,
        snapshot_id=views.snapshot_id,
        version=views.version,
        outcome=build["outcome"],
        mask_reasons=build["mask_reasons"],
        metrics=build["metrics"],
        terminal=build["metrics"].get("terminal_attribution"),
        quarantines=plan.quarantines,
        consumer=consumer,
        handed_off=True,
    )
    return build


def _model_of(views: SnapshotViews, chain: ChainPlan) -> str:
    models = {v.model_call_id: v.model for v in views.calls}
    return models.get(chain.call_ids[-1], "") or next((m for m in models.values() if m), "")


async def _project(
    ledger: Ledger, rollout_id: str, views: SnapshotViews, chain: ChainPlan
) -> dict[str, Any]:
    links = await ledger.load_chain(rollout_id, chain.call_ids[-1], expect=chain.call_ids)
    # Every link was checked against its cumulative digest while the chain was read; the
    # projection lays the verified tokens out once, so its carriers are prefix-contiguous by
    # construction (no O(context) re-comparison per call).
    response = project_chain(rollout_id, links, _model_of(views, chain), owned=True)
    if not response["usage"]["output_tokens"]:
        raise ProjectionError("capture produced no trainable generated tokens")
    return response


async def _execute(
    ledger: Ledger,
    rollout_id: str,
    views: SnapshotViews,
    plan: BuildPlan,
    result: Mapping[str, Any],
    deliver: str,
) -> dict[str, Any]:
    metrics = copy.deepcopy(plan.metrics)
    reasons = list(plan.mask_reasons)
    rebuilt: dict[str, Any] | None = None
    trajectories: list[dict[str, Any]] = []
    failed = False
    if views.incomplete_reasons:
        metrics["incomplete_reasons"] = list(views.incomplete_reasons)
    try:
        if plan.delivered is not None:
            rebuilt = await _project(ledger, rollout_id, views, plan.delivered)
        if deliver == "all-chains":
            for chain in plan.chains:
                response = (
                    rebuilt
                    if plan.delivered is not None and chain.call_ids == plan.delivered.call_ids
                    else await _project(ledger, rollout_id, views, chain)
                )
                trajectories.append(
                    {"label": chain.label, "role": chain.role, "response": response}
                )
    except (ValueError, KeyError, IndexError, TypeError, AssertionError) as exc:
        failed = True
        rebuilt = None
        trajectories = []
        metrics["error"] = f"{type(exc).__name__}: {exc}"
        if "build_failed" not in reasons:
            reasons.append("build_failed")
        terminal = metrics.get("terminal_attribution")
        if isinstance(terminal, dict) and terminal.get("call_id"):
            terminal["chain"] = "error"
    metrics["mask_reasons"] = reasons
    if "no_records" in reasons and not metrics.get("error"):
        if views.incomplete_reasons:  # the calls arrived; recording them failed: say why
            metrics["error"] = (
                "capture contains no token records: every call failed to record "
                f"({', '.join(views.incomplete_reasons)})"
            )
        else:
            metrics["error"] = (
                "capture contains no token records: the rollout's model calls did not reach "
                "the proxy's /ng-rollout/<id>/training-token-capture/ route"
            )
    if rebuilt is not None:
        metrics["prompt_tokens_delivered"] = rebuilt["usage"]["input_tokens"]
    outcome = "failed" if failed else ("masked" if reasons else "delivered")
    build: dict[str, Any] = {
        "rollout_id": rollout_id,
        "outcome": outcome,
        "mask_sample": bool(reasons),
        "mask_reasons": reasons,
        "metrics": metrics,
        "rebuilt_response": rebuilt,
        "snapshot_id": views.snapshot_id,
        "version": views.version,
        "_capture_snapshot": {"snapshot_id": views.snapshot_id, "version": views.version},
        "unresolved_retries": list(plan.unresolved_retries),
        "unresolved_parent_calls": list(plan.unresolved_parent_calls),
    }
    if deliver == "all-chains":
        build["trajectories"] = trajectories
    return build
