"""Finalize and retire rollouts with the seed's semantics (design §5.4, §4.7, §4.8).

``finalize_rollout_token_capture(result, source)`` freezes the rollout, plans the build from
call metadata, reads the delivered chain's tokens once, projects them into ``response.output``
in place, records the build in ``deliveries`` and returns the build.  It never raises: any
failure masks the rollout with its reason.  ``retire_rollout_token_capture`` retires only a
delivered (or redundant) build, with its exact snapshot identity, and only after the caller has
written the rebuilt result durably.

Inside the ledger a build is a typed ``ledger.types.Build`` (``finalize``, ``retire``,
``build_rollout``); the two Gym entry points convert it to and from Gym's build dict once, at
this boundary (``Build.to_wire``, ``Build.from_wire``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any, cast

from ledger.builder import failed_plan, plan_build
from ledger.errors import InvalidRolloutId, ProjectionError
from ledger.gym import LedgerBackend
from ledger.ids import rollout_id_from_run_body
from ledger.model import BuildPlan, ChainPlan
from ledger.projection import project_chain
from ledger.store import Ledger, SnapshotViews
from ledger.types import Build, BuildService, TokenSource, Trajectory

__all__ = [
    "Source",
    "build_rollout",
    "finalize",
    "finalize_rollout_token_capture",
    "retire",
    "retire_rollout_token_capture",
    "retire_snapshot",
]

log = logging.getLogger("rollout_ledger.delivery")

# What finalize and retire accept: the ledger itself, a ledger that builds on its server (both
# are what ``ledger.gym.open_backend`` opens), any NeMo Gym ``TokenSource``, or a client
# fronting a ledger (``CaptureSource``: its ``.backend`` is used).
Source = Ledger | BuildService | LedgerBackend | TokenSource


def _fast_path(source: object) -> Ledger | BuildService | None:
    """The ledger behind ``source`` (a ``Ledger`` builds here, a ``BuildService`` on its
    server), or ``None`` for any other Gym ``TokenSource``."""
    backend = getattr(source, "backend", source)
    if isinstance(backend, Ledger):
        return backend
    if callable(getattr(backend, "finalize", None)):  # the seed's test for a building ledger
        return cast(BuildService, backend)
    return None


def carries_token_ids(result: Mapping[str, Any]) -> bool:
    """True when the rollout's output already holds generated token ids (a native agent)."""
    response = result.get("response")
    output = response.get("output") if isinstance(response, Mapping) else None
    if not isinstance(output, list):
        return False
    return any(
        isinstance(item, Mapping) and bool(item.get("generation_token_ids")) for item in output
    )


# The mask reason reported when the environment (the verifier) had already set ``mask_sample``.
ENVIRONMENT_MASK_REASON = "environment_mask_sample"


def _keep_environment_mask(result: Mapping[str, Any], build: Build) -> Build:
    """An environment's ``mask_sample: true`` stands whatever capture says (as in NeMo Gym):
    name it among the record's mask reasons.  The build's own verdict (``mask_sample``, which
    decides retirement) stays the capture's."""
    if not result.get("mask_sample") or _masked_by_an_earlier_build(result):
        return build
    return build.with_mask_reason(ENVIRONMENT_MASK_REASON)


def _masked_by_an_earlier_build(result: Mapping[str, Any]) -> bool:
    """A result finalized before (it carries ``_ng_token_capture``) whose ``mask_sample`` was
    that build's capture verdict, not the environment's: finalizing it again must not report an
    environment mask."""
    earlier = result.get("_ng_token_capture")
    if not isinstance(earlier, Mapping):
        return False
    reasons = earlier.get("mask_reasons") or ()
    return bool(reasons) and ENVIRONMENT_MASK_REASON not in reasons


def _apply(result: dict[str, Any], build: Build) -> None:
    """Write the build into the rollout result (only ``output``/``usage`` of the response).

    ``mask_sample`` is only ever set, never cleared: an environment's mask stands."""
    rebuilt = build.rebuilt_response
    if rebuilt is not None:
        response = result.get("response")
        if isinstance(response, dict):
            response["output"] = rebuilt["output"]
            response["usage"] = rebuilt["usage"]
        else:
            result["response"] = rebuilt
    result["_ng_token_capture"] = build.metrics
    if build.mask_sample:
        result["mask_sample"] = True


async def finalize(
    result: dict[str, Any], source: Source, *, deliver: str = "one", consumer: str = ""
) -> Build:
    """Rebuild ``result["response"]["output"]`` in place from the captured calls; the typed
    build.  Never raises: a failure masks the rollout with its reason."""
    try:
        rollout_id = rollout_id_from_run_body(result)
    except InvalidRolloutId as exc:
        build = Build.masked_before_build(
            None, f"malformed rollout id: {exc}", "malformed_rollout_id"
        )
        _apply(result, build)
        return build
    if rollout_id is None:
        build = Build.masked_before_build(None, "no capture key", "no_capture_key")
        _apply(result, build)
        return build
    try:
        build = await _build_from(source, result, rollout_id, deliver=deliver, consumer=consumer)
    except Exception as exc:  # the source itself failed: mask, keep everything for diagnosis
        log.warning("finalize failed for rollout %s: %s", rollout_id, exc)
        build = Build.masked_before_build(
            rollout_id, f"{type(exc).__name__}: {exc}", "source_error"
        )
    if build.outcome != "redundant":
        build = _keep_environment_mask(result, build)
        _apply(result, build)
    return build


async def _build_from(
    source: Source, result: dict[str, Any], rollout_id: str, *, deliver: str, consumer: str
) -> Build:
    backend = _fast_path(source)
    if isinstance(backend, Ledger):
        return await build_rollout(backend, result, deliver=deliver, consumer=consumer)
    if backend is not None:  # a remote ledger builds on its server
        return await backend.finalize(result, deliver=deliver, consumer=consumer)
    if not isinstance(source, TokenSource):
        raise TypeError(f"{type(source).__name__} is neither a ledger nor a TokenSource")
    # Any other TokenSource: its frozen entries, through the same ingest and builder.
    from ledger.source_build import build_from_source

    return await build_from_source(
        source, result, rollout_id, build_rollout, deliver=deliver, consumer=consumer
    )


async def finalize_rollout_token_capture(
    result: dict[str, Any], source: Source | None, *, deliver: str = "one", consumer: str = ""
) -> dict[str, Any] | None:
    """NeMo Gym's entry point: ``finalize`` with the build in Gym's shape (``Build.to_wire``).

    Returns the build (outcome, mask reasons, metrics, snapshot identity), or ``None`` when
    ``source`` is ``None``.  Never raises: a failure masks the rollout with its reason.
    """
    if source is None:
        return None
    build = await finalize(result, source, deliver=deliver, consumer=consumer)
    return build.to_wire()


async def retire(rollout_id: str, source: Source, built: Build | None) -> bool:
    """Retire a delivered build's records, by its exact snapshot identity.

    Call only after the rebuilt result is durably stored.  Masked and failed builds are never
    retired: their records stay for diagnosis.  Returns whether the records were retired.
    """
    if built is None or not built.retirable or built.snapshot_id is None or built.version is None:
        return False
    return await retire_snapshot(
        rollout_id,
        source,
        snapshot_id=built.snapshot_id,
        version=built.version,
        delivery_id=built.delivery_id,
    )


async def retire_snapshot(
    rollout_id: str,
    source: Source,
    *,
    snapshot_id: str,
    version: int,
    delivery_id: int | None = None,
) -> bool:
    """Retire exactly this snapshot of a build the caller delivered unmasked and stored durably
    (``collect`` resuming after a crash: the row it wrote names the snapshot).  Acknowledges the
    delivery row first when there is one.  Never raises."""
    backend = _fast_path(source)
    try:
        if backend is None:  # any other TokenSource retires through its own ``drop``
            if not isinstance(source, TokenSource):
                raise TypeError(f"{type(source).__name__} has no drop()")
            return bool(await source.drop(rollout_id, snapshot_id=snapshot_id, version=version))
        if delivery_id is not None:
            await backend.mark_delivery(delivery_id, durable=True)
        return bool(await backend.retire(rollout_id, snapshot_id=snapshot_id, version=version))
    except Exception as exc:
        log.warning("retire failed for rollout %s: %s", rollout_id, exc)
        return False


async def retire_rollout_token_capture(
    rollout_id: str, source: Source, built: Build | Mapping[str, Any] | None
) -> bool:
    """NeMo Gym's entry point: ``retire`` for a build in Gym's shape (or a typed one)."""
    if built is None or isinstance(built, Build):
        return await retire(rollout_id, source, built)
    if not built:
        return False
    try:
        typed = Build.from_wire(built)
    except (ValueError, TypeError, KeyError):
        return False
    return await retire(rollout_id, source, typed)


# --------------------------------------------------------------------------- the build itself


async def build_rollout(
    ledger: Ledger, result: dict[str, Any], *, deliver: str = "one", consumer: str = ""
) -> Build:
    """Freeze, plan, read the delivered chain once, project, and record the delivery row.

    ``result`` is only read here; ``finalize`` applies the build.
    """
    rollout_id = rollout_id_from_run_body(result)
    if rollout_id is None:
        return Build.masked_before_build(None, "no capture key", "no_capture_key")
    if carries_token_ids(result):
        state = await ledger.freeze_state(rollout_id)  # fence late writes all the same
        return Build.redundant(rollout_id, state.snapshot_id, state.version)
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
    build = await _execute(ledger, rollout_id, views, plan, deliver)
    delivery_id = await ledger.record_delivery(
        rollout_id,
        snapshot_id=views.snapshot_id,
        version=views.version,
        outcome=build.outcome,
        mask_reasons=list(build.mask_reasons),
        metrics=dict(build.metrics),
        terminal=None if build.terminal is None else dict(build.terminal),
        quarantines=plan.quarantines,
        consumer=consumer,
        handed_off=True,
    )
    return build.with_delivery(delivery_id)


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
    deliver: str,
) -> Build:
    metrics = copy.deepcopy(plan.metrics)
    reasons = list(plan.mask_reasons)
    rebuilt: dict[str, Any] | None = None
    trajectories: list[Trajectory] = []
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
                    if rebuilt is not None
                    and plan.delivered is not None
                    and chain.call_ids == plan.delivered.call_ids
                    else await _project(ledger, rollout_id, views, chain)
                )
                trajectories.append(Trajectory(chain.label, chain.role, response))
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
    return Build.built(
        rollout_id,
        failed=failed,
        mask_reasons=reasons,
        metrics=metrics,
        rebuilt_response=rebuilt,
        snapshot_id=views.snapshot_id,
        version=views.version,
        unresolved_retries=plan.unresolved_retries,
        unresolved_parent_calls=plan.unresolved_parent_calls,
        trajectories=trajectories if deliver == "all-chains" else None,
    )
