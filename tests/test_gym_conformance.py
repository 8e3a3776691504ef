"""NeMo Gym-compatible classes and the conformance kit (issue #2 points 8 and 9)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import CliRunner

from ledger.cli import app, load_object
from ledger.conformance import CHECKS, ConformanceError, run_conformance
from ledger.errors import PayloadConflict
from ledger.gym import CaptureLineageStore, CaptureSink, CaptureSource
from ledger.records import TokenEntry
from tests.test_promises import rec

Rid = Callable[[str], str]


async def test_classes_are_constructible_by_import_path_with_kwargs(db_url: str, rid: Rid) -> None:
    sink_kwargs = {"url": db_url}
    sink = load_object("ledger.gym:CaptureSink")(**sink_kwargs)
    source = load_object("ledger.gym:CaptureSource")(**sink_kwargs)
    lineage = load_object("ledger.gym:CaptureLineageStore")(**sink_kwargs)
    r = rid("gym")
    try:
        await sink.begin_call(r, "c1")
        await sink.put(rec(r, "c1", [1, 2, 3], [4, 5]))  # a dict
        await sink.put(TokenEntry.model_validate(rec(r, "c2", [1, 2, 3, 4, 5, 6], [7])))
        res = await lineage.resolve_prompt(r, [1, 2, 3, 4, 5, 6, 7, 8])
        assert (res.status, res.model_call_id) == ("resolved", "c2")
        assert res.cumulative_token_ids == [1, 2, 3, 4, 5, 6, 7]
        assert lineage.is_process_shared()
        snap = await source.freeze(r)
        assert snap.rollout_id == r and not snap.incomplete
        assert [e.prompt_token_ids for e in snap.entries] == [[1, 2, 3], [1, 2, 3, 4, 5, 6]]
        assert await source.drop(r, snapshot_id=snap.snapshot_id, version=snap.version)
    finally:
        for c in (sink, source, lineage):
            await c.close()
            await c.close()  # idempotent


async def test_sink_mark_incomplete_and_cancel(db_url: str, rid: Rid) -> None:
    sink, source = CaptureSink(url=db_url), CaptureSource(url=db_url)
    r = rid("gymmark")
    try:
        await sink.begin_call(r, "c1")
        await sink.cancel_call(r, "c1")
        assert not (await source.freeze(r)).incomplete
        r2 = rid("gymmark2")
        await sink.mark_incomplete(r2, model_call_id="c9", reason="missing_token_ids")
        assert (await source.freeze(r2)).incomplete
    finally:
        await sink.close()
        await source.close()


async def test_conformance_passes(db_url: str) -> None:
    passed = await run_conformance(
        sink_factory=lambda: CaptureSink(url=db_url),
        source_factory=lambda: CaptureSource(url=db_url),
        lineage_factory=lambda: CaptureLineageStore(url=db_url),
    )
    assert passed == list(CHECKS)


async def test_conformance_without_lineage_skips_lineage_checks(db_url: str) -> None:
    passed = await run_conformance(
        sink_factory=lambda: CaptureSink(url=db_url),
        source_factory=lambda: CaptureSource(url=db_url),
    )
    assert "lineage_visibility" not in passed and "begin_call_custody" in passed


class OverwritingSink(CaptureSink):
    """Broken on purpose: a conflicting re-put replaces the first record silently."""

    async def put(self, entry: TokenEntry | dict[str, Any]) -> None:
        try:
            await super().put(entry)
        except PayloadConflict as exc:
            assert exc.rollout_id is not None
            await self.backend.delete_rollout(exc.rollout_id)  # type: ignore[attr-defined]
            await super().put(entry)


class VersionBlindSource(CaptureSource):
    """Broken on purpose: drop retires whatever is frozen now, ignoring the version."""

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        current = await self.freeze(rollout_id)
        return await super().drop(rollout_id, snapshot_id=snapshot_id, version=current.version)


class RaisingSink(CaptureSink):
    async def put(self, entry: TokenEntry | dict[str, Any]) -> None:
        raise RuntimeError("backend down")


@pytest.mark.parametrize(
    ("sink_cls", "source_cls", "failed_check", "needle"),
    [
        (OverwritingSink, CaptureSource, "conflicting_reput", "neither raised"),
        (CaptureSink, VersionBlindSource, "mark_incomplete_durability", "stale drop"),
        (RaisingSink, CaptureSource, "put_then_freeze_visibility", "unexpected RuntimeError"),
    ],
)
async def test_broken_backends_fail_with_the_check_name(
    db_url: str, sink_cls: type, source_cls: type, failed_check: str, needle: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        await run_conformance(
            sink_factory=lambda: sink_cls(url=db_url),
            source_factory=lambda: source_cls(url=db_url),
            lineage_factory=lambda: CaptureLineageStore(url=db_url),
        )
    assert info.value.check == failed_check
    assert needle in info.value.detail
    assert isinstance(info.value, AssertionError)


def test_cli_conformance_runs_classes_by_import_path(db_url: str) -> None:
    result = CliRunner().invoke(app, ["conformance", "--db", db_url])
    assert result.exit_code == 0, result.output
    assert f"{len(CHECKS)} checks passed" in result.output


def test_cli_conformance_reports_the_failed_check(db_url: str) -> None:
    result = CliRunner().invoke(
        app,
        ["conformance", "--db", db_url, "--sink", "tests.test_gym_conformance:RaisingSink"],
    )
    assert result.exit_code == 1
    assert "put_then_freeze_visibility" in result.output


def test_cli_conformance_rejects_a_bad_import_path() -> None:
    result = CliRunner().invoke(app, ["conformance", "--sink", "no.such.module:Thing"])
    assert result.exit_code == 2 and "cannot import" in result.output
