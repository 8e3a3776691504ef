"""The typed build (``ledger.types.Build``): one constructor per way a build arises, and the one
conversion to NeMo Gym's build dict, key for key."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ledger.types import Build, Trajectory


def test_masked_before_build_has_the_seed_shape() -> None:
    build = Build.masked_before_build("3-0", "no capture key", "no_capture_key")
    wire = build.to_wire()
    assert list(wire) == [
        "rollout_id",
        "outcome",
        "mask_sample",
        "mask_reasons",
        "metrics",
        "rebuilt_response",
        "snapshot_id",
        "version",
        "delivery_id",
    ]
    assert wire["outcome"] == "failed" and wire["mask_sample"] is True
    assert wire["mask_reasons"] == ["no_capture_key"]
    assert wire["metrics"] == {
        "n_calls": 0,
        "error": "no capture key",
        "mask_reasons": ["no_capture_key"],
    }
    assert not build.retirable
    assert build.error == "no capture key"


def test_redundant_capture_keeps_its_shadow_keys() -> None:
    wire = Build.redundant("3-0", "snap", 4).to_wire()
    assert list(wire) == [
        "rollout_id",
        "outcome",
        "mask_sample",
        "mask_reasons",
        "metrics",
        "rebuilt_response",
        "snapshot_id",
        "version",
        "_capture_snapshot",
        "delivery_id",
        "_redundant_capture",
    ]
    assert wire["_capture_snapshot"] == {"snapshot_id": "snap", "version": 4}
    assert wire["_redundant_capture"] is True and wire["mask_sample"] is False
    assert Build.redundant("3-0", "snap", 4).retirable


def _built(**kw: Any) -> Build:
    args: dict[str, Any] = {
        "failed": False,
        "mask_reasons": [],
        "metrics": {"n_calls": 2, "mask_reasons": []},
        "rebuilt_response": {"output": [], "usage": {}},
        "snapshot_id": "s",
        "version": 2,
        "unresolved_retries": [],
        "unresolved_parent_calls": ["c9"],
        "trajectories": None,
    }
    args.update(kw)
    return Build.built("3-0", **args)


@pytest.mark.parametrize(
    ("failed", "reasons", "outcome"),
    [(False, [], "delivered"), (False, ["unresolved_retry"], "masked"), (True, ["x"], "failed")],
)
def test_built_outcome_follows_failure_and_reasons(
    failed: bool, reasons: list[str], outcome: str
) -> None:
    build = _built(failed=failed, mask_reasons=reasons)
    assert build.outcome == outcome
    assert build.mask_sample is bool(reasons)
    assert build.retirable is (outcome == "delivered")


def test_built_wire_shape_and_round_trip() -> None:
    traj = Trajectory("main", "terminal", {"output": [], "usage": {}})
    build = _built(trajectories=[traj]).with_delivery(7)
    wire = build.to_wire()
    assert list(wire) == [
        "rollout_id",
        "outcome",
        "mask_sample",
        "mask_reasons",
        "metrics",
        "rebuilt_response",
        "snapshot_id",
        "version",
        "_capture_snapshot",
        "unresolved_retries",
        "unresolved_parent_calls",
        "trajectories",
        "delivery_id",
    ]
    assert wire["trajectories"] == [
        {"label": "main", "role": "terminal", "response": traj.response}
    ]
    assert wire["delivery_id"] == 7
    assert Build.from_wire(json.loads(json.dumps(wire))) == build


def test_the_http_answer_and_a_remote_build_carry_no_rebuilt_response() -> None:
    build = _built()
    slim = build.to_wire(with_response=False)
    assert "rebuilt_response" not in slim
    remote = Build.from_wire(slim, remote=True)
    assert remote.to_wire() == slim


def test_a_foreign_snapshot_relabels_identity_and_drops_the_delivery_row() -> None:
    build = _built().with_delivery(3).at_snapshot("snap-7", 9)
    wire = build.to_wire()
    assert (wire["snapshot_id"], wire["version"], wire["delivery_id"]) == ("snap-7", 9, None)
    assert wire["_capture_snapshot"] == {"snapshot_id": "snap-7", "version": 9}


def test_an_environment_mask_is_reported_without_changing_the_verdict() -> None:
    build = _built().with_mask_reason("environment_mask_sample")
    assert build.mask_sample is False and build.outcome == "delivered"
    assert build.mask_reasons == ("environment_mask_sample",)
    assert build.metrics["mask_reasons"] == ["environment_mask_sample"]
    again = build.with_mask_reason("environment_mask_sample")
    assert again.mask_reasons == build.mask_reasons
    assert again.metrics["mask_reasons"] == ["environment_mask_sample"]


def test_from_wire_refuses_an_unknown_outcome() -> None:
    with pytest.raises(ValueError, match="unknown build outcome"):
        Build.from_wire({"outcome": "shipped"})
