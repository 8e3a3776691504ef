"""``rollout-ledger collect`` and ``audit`` (issue #3 points 6-8), on SQLite and Postgres."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ledger.collect import CollectAborted, CollectRefused, collect
from ledger.store import Ledger
from tests.test_cli import cli
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
    res = cli("collect", "--db", db_url, "-i", str(src), "-o", str(dst))
    assert res.returncode == 0, res.stderr
    assert "collection health" in res.stdout and "capture_incomplete" in res.stdout
    assert "in.jsonl:3: malformed row skipped" in res.stderr

    res = cli("audit", "masked", "--db", db_url, "--reason", "capture_incomplete", "--json")
    assert res.returncode == 0, res.stderr
    masked = json.loads(res.stdout)
    assert bad in [m["rollout_id"] for m in masked] and good not in [
        m["rollout_id"] for m in masked
    ]
    (row,) = [m for m in masked if m["rollout_id"] == bad]
    assert row["incomplete_reasons"] == ["dangling_intent"]  # the cause, not only the mask

    res = cli("audit", "show", bad, "--db", db_url)
    assert res.returncode == 0, res.stderr
    for needle in ("lineage edges", "dangling_intent", "deliveries", "masked"):
        assert needle in res.stdout

    res = cli("audit", "show", bad, "--db", db_url, "--json")
    detail = json.loads(res.stdout)
    assert [c["status"] for c in detail["calls"]] == ["captured", "intent"]

    res = cli("audit", "stats", "--db", db_url, "--json")
    stats = json.loads(res.stdout)
    assert stats["builds_by_outcome"].get("masked", 0) >= 1
    assert stats["mask_reasons"].get("capture_incomplete", 0) >= 1

    res = cli("audit", "show", "no-such-rollout", "--db", db_url)
    assert res.returncode == 1 and "no rollout" in res.stderr


def test_cli_collect_aborts_with_reason_histogram(db_url: str, rid: Rid, tmp_path: Path) -> None:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(rid("none")) for _ in range(3)])
    res = cli(
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
    )
    assert res.returncode == 3, res.stderr
    assert "no_records" in res.stdout + res.stderr and "aborted" in res.stderr


def test_cli_collect_reads_limits_from_config(db_url: str, rid: Rid, tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("token_id_capture:\n  max_mask_fraction: 0.1\n  mask_fraction_min_samples: 1\n")
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(rid("none")) for _ in range(2)])
    res = cli("collect", "--db", db_url, "-i", str(src), "-o", str(dst), "--config", str(cfg))
    assert res.returncode == 3, res.stderr


def test_cli_collect_guards_the_mask_fraction_by_default(
    db_url: str, rid: Rid, tmp_path: Path
) -> None:
    """No flag, no config: a run where most rollouts are masked stops (issue 14 point 4)."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(rid("none")) for _ in range(12)])
    res = cli("collect", "--db", db_url, "-i", str(src), "-o", str(dst), "--concurrency", "1")
    assert res.returncode == 3, res.stderr
    assert "exceeding max_mask_fraction=0.5" in res.stderr
    off = cli("collect", "--db", db_url, "-i", str(src), "-o", str(dst), "--max-mask-fraction", "1")
    assert off.returncode == 0, off.stderr


# --------------------------------------------------------------------------- duplicate ids


async def test_duplicate_rollout_ids_deliver_the_first_row_only(
    ledger: Ledger, rid: Rid, tmp_path: Path
) -> None:
    """Issue 10 point 5d: two rows with one rollout id; the first is delivered, always."""
    (r,) = await good_rollouts(ledger, rid, 1)
    (other,) = await good_rollouts(ledger, rid, 1)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [result_for(r, tag="first"), result_for(other), result_for(r, tag="second")]
    write_rows(src, rows)
    report = await collect(ledger, src, dst, concurrency=8)
    written = read_rows(dst)
    assert sorted(w["_ng_rollout_id"] for w in written) == sorted([r, other])
    (delivered,) = [w for w in written if w["_ng_rollout_id"] == r]
    assert delivered["tag"] == "first" and "mask_sample" not in delivered
    assert report.duplicate_rows == [(3, r, 1)]
    assert report.as_dict()["duplicate_rows"] == [{"line": 3, "rollout_id": r, "first_line": 1}]
    # A re-run neither writes the duplicate nor the first row again.
    again = await collect(ledger, src, dst, concurrency=8)
    assert again.written == 0 and again.duplicate_rows == [(3, r, 1)]
    assert len(read_rows(dst)) == 2


def test_cli_reports_duplicate_rollout_ids(db_url: str, rid: Rid, tmp_path: Path) -> None:
    async def setup() -> str:
        led = Ledger(db_url)
        try:
            (r,) = await good_rollouts(led, rid, 1)
            return r
        finally:
            await led.close()

    r = asyncio.run(setup())
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # Index-keyed and explicit ids that name the same rollout are duplicates too.
    write_rows(src, [result_for(r, tag="a"), result_for(r, tag="b")])
    res = cli("collect", "--db", db_url, "-i", str(src), "-o", str(dst), "--json")
    assert res.returncode == 0, res.stderr
    assert f"in.jsonl:2: rollout {r} already appears on line 1" in res.stderr
    assert json.loads(res.stdout)["duplicate_rows"] == [
        {"line": 2, "rollout_id": r, "first_line": 1}
    ]
    assert [w["tag"] for w in read_rows(dst)] == ["a"]


# --------------------------------------------------------------------------- refused arguments


async def test_collect_refuses_paths_that_cannot_work(ledger: Ledger, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    write_rows(src, [{"_ng_rollout_id": "x"}])
    with pytest.raises(CollectRefused, match="same file"):
        await collect(ledger, src, src)
    link = tmp_path / "link.jsonl"
    link.symlink_to(src)
    with pytest.raises(CollectRefused, match="same file"):
        await collect(ledger, src, link)
    with pytest.raises(CollectRefused, match="does not exist"):
        await collect(ledger, src, tmp_path / "no" / "dir" / "out.jsonl")
    assert not (tmp_path / "no").exists()
    assert src.read_text().count("\n") == 1


def test_cli_collect_refuses_same_file_and_missing_directory(db_url: str, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    write_rows(src, [{"_ng_rollout_id": "x"}])
    res = cli("collect", "--db", db_url, "-i", str(src), "-o", str(src))
    assert res.returncode == 2 and "are the same file" in res.stderr
    missing = tmp_path / "nonexistent" / "dir" / "x.jsonl"
    res = cli("collect", "--db", db_url, "-i", str(src), "-o", str(missing))
    assert res.returncode == 2 and "does not exist" in res.stderr
    assert not (tmp_path / "nonexistent").exists()


# --------------------------------------------------------------------------- resume


async def test_resume_rebuilds_rows_an_older_collect_masked_for_a_ledger_failure(
    ledger: Ledger, rid: Rid, tmp_path: Path
) -> None:
    """Issue 14 point 2: a row masked because the ledger failed was never built: rebuild it."""
    ids = await good_rollouts(ledger, rid, 2)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(r) for r in ids])
    # What an older version wrote when the database was unreachable.
    stale = result_for(ids[0])
    stale["mask_sample"] = True
    stale["_ng_token_capture"] = {
        "n_calls": 0,
        "error": "Unavailable: ledger database unavailable: connection refused",
        "mask_reasons": ["source_error"],
    }
    stale["_ng_input_line"] = 1
    write_rows(dst, [stale])
    report = await collect(ledger, src, dst)
    rows = read_rows(dst)
    assert sorted(r["_ng_rollout_id"] for r in rows) == sorted(ids)
    assert all("mask_sample" not in r for r in rows)
    assert report.reprocessed_source_errors == 1 and report.written == 2


async def test_a_rollout_whose_calls_all_failed_to_record_names_that_cause(
    ledger: Ledger, rid: Rid
) -> None:
    """Issue 14 point 7: not "did not reach the proxy" when the proxy saw the call."""
    from ledger.delivery import finalize_rollout_token_capture

    r = rid("bad-payload")
    await ledger.mark_incomplete(r, "c0", reason="malformed_token_payload", detail="56 ids, 55")
    result = result_for(r)
    build = await finalize_rollout_token_capture(result, ledger)
    assert build is not None and build["mask_sample"]
    error = result["_ng_token_capture"]["error"]
    assert "malformed_token_payload" in error and "did not reach" not in error


def test_cli_collect_into_a_new_output_never_remasks_delivered_rollouts(
    db_url: str, rid: Rid, tmp_path: Path
) -> None:
    """Issue 14 point 2: after the output is deleted, delivered rollouts are reported, not
    written back masked, and the run does not claim success."""

    async def setup() -> list[str]:
        led = Ledger(db_url)
        try:
            return await good_rollouts(led, rid, 2)
        finally:
            await led.close()

    ids = asyncio.run(setup())
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(r) for r in ids])
    assert cli("collect", "--db", db_url, "-i", str(src), "-o", str(dst)).returncode == 0
    dst.unlink()
    res = cli("collect", "--db", db_url, "-i", str(src), "-o", str(dst))
    assert res.returncode == 1, res.stderr
    assert "already delivered and retired" in res.stderr
    assert not dst.exists() or read_rows(dst) == []
