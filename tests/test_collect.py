"""``rollout-ledger collect`` and ``audit`` (issue #3 points 6-8), on SQLite and Postgres."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledger.cli import app
from ledger.collect import CollectAborted, collect
from ledger.store import Ledger
from tests.test_delivery import Scripted, result_for, tool_loop

Rid = Callable[[str], str]


def write_rows(path: Path, rows: list[Any]) -> None:
    with path.open("w") as fh:
        for row in rows:
            fh.write(row if isinstance(row, str) else json.dumps(row))
            fh.write("\n")


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def good_rollouts(ledger: Ledger, rid: Rid, n: int) -> list[str]:
    ids = []
    for i in range(n):
        r = rid(f"col{i}")
        await tool_loop(Scripted(ledger, r), 2)
        ids.append(r)
    return ids


async def test_collect_writes_fsyncs_then_retires(ledger: Ledger, rid: Rid, tmp_path: Path) -> None:
    ids = await good_rollouts(ledger, rid, 3)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(r) for r in ids])
    report = await collect(ledger, src, dst, concurrency=2)
    rows = read_rows(dst)
    assert sorted(r["_ng_rollout_id"] for r in rows) == sorted(ids)
    assert all("mask_sample" not in r for r in rows)
    assert report.written == 3 and report.retired == 3 and report.masked == 0
    for r in ids:
        assert (await ledger.get_state(r)).state == "retired"


async def test_collect_reports_malformed_lines_and_continues(
    ledger: Ledger, rid: Rid, tmp_path: Path
) -> None:
    (good,) = await good_rollouts(ledger, rid, 1)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, ["{not json", result_for(good), "[1, 2]", {"no": "capture key"}])
    report = await collect(ledger, src, dst)
    assert [line for line, _ in report.malformed_lines] == [1, 3]
    assert report.written == 2 and report.masked == 1
    assert report.mask_reasons["no_capture_key"] == 1


async def test_collect_aborts_over_max_mask_fraction(
    ledger: Ledger, rid: Rid, tmp_path: Path
) -> None:
    ids = await good_rollouts(ledger, rid, 1)
    rows = [result_for(rid("empty")) for _ in range(4)] + [result_for(r) for r in ids]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, rows)
    with pytest.raises(CollectAborted, match=r"exceeding max_mask_fraction=0\.5") as info:
        await collect(ledger, src, dst, max_mask_fraction=0.5, min_samples=2, concurrency=1)
    assert info.value.report.mask_reasons["no_records"] >= 2
    # The row that crossed the limit was not written.
    assert len(read_rows(dst)) < info.value.report.finalized


async def test_collect_resumes_after_a_crash_without_loss_or_duplicates(
    ledger: Ledger, rid: Rid, tmp_path: Path
) -> None:
    ids = await good_rollouts(ledger, rid, 4)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(r) for r in ids])
    written = 0

    async def crash_after_two() -> None:
        nonlocal written
        written += 1
        if written == 3:
            raise RuntimeError("simulated crash before the third write")

    with pytest.raises(RuntimeError, match="simulated crash"):
        await collect(ledger, src, dst, concurrency=1, write_hook=crash_after_two)
    # A torn line from a process that died mid-write.
    with dst.open("ab") as fh:
        fh.write(b'{"_ng_rollout_id": "torn", "respo')
    partial = read_rows_tolerant(dst)
    assert len(partial) == 2
    report = await collect(ledger, src, dst, concurrency=1)
    rows = read_rows(dst)
    assert sorted(r["_ng_rollout_id"] for r in rows) == sorted(ids)
    assert report.skipped_already_written == 2 and report.written == 2
    for r in ids:
        assert (await ledger.get_state(r)).state == "retired"


def read_rows_tolerant(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


async def test_resume_retires_rows_written_before_a_crash(
    ledger: Ledger, rid: Rid, tmp_path: Path
) -> None:
    (r,) = await good_rollouts(ledger, rid, 1)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(r)])
    # Simulate: the row was written and fsynced, then the process died before retiring.
    result = result_for(r)
    from ledger.delivery import finalize_rollout_token_capture

    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None
    result["_ng_capture_snapshot"] = {
        "snapshot_id": build["snapshot_id"],
        "version": build["version"],
    }
    write_rows(dst, [result])
    report = await collect(ledger, src, dst)
    assert report.retired_on_resume == 1 and report.written == 0
    assert (await ledger.get_state(r)).state == "retired"
    assert len(read_rows(dst)) == 1


async def test_collect_all_chains_writes_one_row_per_chain(
    ledger: Ledger, rid: Rid, tmp_path: Path
) -> None:
    r = rid("multi")
    s = Scripted(ledger, r)
    await s.call("title", [6000, 6001], [6100])
    ctx = await s.call("c0", list(range(50)), [2000])
    await s.call("c1", [*ctx, 3000], [2100], response_id="chatcmpl-final")
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(r, response={"id": "chatcmpl-final", "output": []})])
    await collect(ledger, src, dst, deliver="all-chains")
    rows = read_rows(dst)
    assert sorted(row["_ng_trajectory"]["role"] for row in rows) == ["side", "terminal"]


def test_cli_collect_and_audit(db_url: str, rid: Rid, tmp_path: Path) -> None:
    async def setup() -> tuple[str, str]:
        led = Ledger(db_url)
        try:
            (good,) = await good_rollouts(led, rid, 1)
            bad = rid("incomplete")
            await tool_loop(Scripted(led, bad), 1)
            await led.begin_call(bad, "lost")
            return good, bad
        finally:
            await led.close()

    good, bad = asyncio.run(setup())
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(good), result_for(bad), "oops"])
    runner = CliRunner()
    res = runner.invoke(app, ["collect", "--db", db_url, "-i", str(src), "-o", str(dst)])
    assert res.exit_code == 0, res.output
    assert "collection health" in res.output and "capture_incomplete" in res.output
    assert "in.jsonl:3: malformed row skipped" in res.output

    res = runner.invoke(
        app, ["audit", "masked", "--db", db_url, "--reason", "capture_incomplete", "--json"]
    )
    assert res.exit_code == 0, res.output
    masked = json.loads(res.stdout)
    assert bad in [m["rollout_id"] for m in masked] and good not in [
        m["rollout_id"] for m in masked
    ]

    res = runner.invoke(app, ["audit", "show", bad, "--db", db_url])
    assert res.exit_code == 0, res.output
    for needle in ("lineage edges", "dangling_intent", "deliveries", "masked"):
        assert needle in res.output

    res = runner.invoke(app, ["audit", "show", bad, "--db", db_url, "--json"])
    detail = json.loads(res.stdout)
    assert [c["status"] for c in detail["calls"]] == ["captured", "intent"]

    res = runner.invoke(app, ["audit", "stats", "--db", db_url, "--json"])
    stats = json.loads(res.stdout)
    assert stats["builds_by_outcome"].get("masked", 0) >= 1
    assert stats["mask_reasons"].get("capture_incomplete", 0) >= 1

    res = runner.invoke(app, ["audit", "show", "no-such-rollout", "--db", db_url])
    assert res.exit_code == 1 and "no rollout" in res.output


def test_cli_collect_aborts_with_reason_histogram(db_url: str, rid: Rid, tmp_path: Path) -> None:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(rid("none")) for _ in range(3)])
    res = CliRunner().invoke(
        app,
        [
            "collect",
            "--db",
            db_url,
            "-i",
            str(src),
            "-o",
            str(dst),
            "--max-mask-fraction",
            "0.1",
            "--min-samples",
            "2",
            "--concurrency",
            "1",
        ],
    )
    assert res.exit_code == 3
    assert "no_records" in res.output and "aborted" in res.output


def test_cli_collect_reads_limits_from_config(db_url: str, rid: Rid, tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("token_id_capture:\n  max_mask_fraction: 0.1\n  mask_fraction_min_samples: 1\n")
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(rid("none")) for _ in range(2)])
    res = CliRunner().invoke(
        app, ["collect", "--db", db_url, "-i", str(src), "-o", str(dst), "--config", str(cfg)]
    )
    assert res.exit_code == 3, res.output
