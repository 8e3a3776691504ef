"""``collect`` and ``audit`` against a running ``rollout-ledger serve`` and the audit output
(issue 14 points 1, 2, 7, 11), through the real entry point, on SQLite and Postgres.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ledger.store import Ledger
from tests.test_cli import Served, clean_env, cli, one_line_error
from tests.test_collect import good_rollouts, read_rows, write_rows
from tests.test_delivery import Scripted, result_for, tool_loop

Rid = Callable[[str], str]


@pytest.fixture
def served() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for s in started:
        s.stop()


ING, TR, AU = "ing-tok-0123456789abcdef", "tr-tok-0123456789abcdef", "au-tok-0123456789abcdef"
TOKENS = f"{ING}=ingest;{TR}=trainer;{AU}=audit"


def serve(db_url: str, served: list[Served]) -> Served:
    s = Served("serve", "--db", db_url, env=clean_env(ROLLOUT_LEDGER_TOKENS=TOKENS))
    served.append(s)
    return s


def setup_rollouts(db_url: str, rid: Rid, n: int = 2) -> list[str]:
    async def go() -> list[str]:
        led = Ledger(db_url)
        try:
            return await good_rollouts(led, rid, n)
        finally:
            await led.close()

    return asyncio.run(go())


def test_collect_stops_on_a_refused_token_and_resumes_with_the_right_one(
    db_url: str, rid: Rid, tmp_path: Path, served: list[Served]
) -> None:
    """Points 1-2: a token without the trainer scope writes nothing masked and exits non-zero;
    the re-run with the right token delivers every row."""
    ids = setup_rollouts(db_url, rid, 3)
    service = serve(db_url, served)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(r) for r in ids])
    res = cli("collect", "--db", service.url, "--token", ING, "-i", str(src), "-o", str(dst))
    assert res.returncode == 1, res.stderr
    assert "refused the API token" in res.stderr and "re-run" in res.stderr
    assert not dst.exists() or read_rows(dst) == []
    ok = cli("collect", "--db", service.url, "--token", TR, "-i", str(src), "-o", str(dst))
    assert ok.returncode == 0, ok.stderr
    rows = read_rows(dst)
    assert sorted(r["_ng_rollout_id"] for r in rows) == sorted(ids)
    assert not any(r.get("mask_sample") for r in rows)
    assert all(
        any(item.get("generation_token_ids") for item in r["response"]["output"]) for r in rows
    )


def test_collect_with_an_unreachable_database_writes_nothing(tmp_path: Path) -> None:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for("r-1"), result_for("r-2")])
    for db in (
        "postgresql://postgres@127.0.0.1:1/ledger",
        f"sqlite+aiosqlite:///{tmp_path / 'missing.db'}",
        "http://127.0.0.1:1",
    ):
        res = cli("collect", "--db", db, "-i", str(src), "-o", str(dst), timeout=300)
        assert res.returncode == 1, (db, res.stderr)
        assert "Traceback" not in res.stderr
        assert not dst.exists(), db
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_audit_over_http_needs_the_audit_scope(db_url: str, rid: Rid, served: list[Served]) -> None:
    (r,) = setup_rollouts(db_url, rid, 1)
    service = serve(db_url, served)
    res = cli("audit", "list", "--db", service.url, "--token", AU, "--json", "--limit", "5000")
    assert res.returncode == 0, res.stderr
    assert r in [i["rollout_id"] for i in json.loads(res.stdout)]
    res = cli("audit", "show", r, "--db", service.url, "--token", AU, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["rollout"]["rollout_id"] == r
    res = cli("audit", "stats", "--db", service.url, "--token", AU, "--json")
    assert res.returncode == 0 and "rollouts_by_state" in json.loads(res.stdout)
    line = one_line_error(cli("audit", "stats", "--db", service.url, "--token", TR))
    assert "audit scope" in line


def test_audit_names_the_cause_and_checks_the_reason(db_url: str, rid: Rid, tmp_path: Path) -> None:
    """Point 7: the cause behind capture_incomplete is shown and searchable; a bogus reason is
    an error, not an empty table."""
    bad = rid("missing-ids")

    async def go() -> None:
        led = Ledger(db_url)
        try:
            await tool_loop(Scripted(led, bad), 2)
            await led.mark_incomplete(bad, "c9", reason="missing_token_ids", detail="no ids")
        finally:
            await led.close()

    asyncio.run(go())
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(bad)])
    assert cli("collect", "--db", db_url, "-i", str(src), "-o", str(dst)).returncode == 0
    res = cli("audit", "masked", "--db", db_url, "--reason", "missing_token_ids", "--wide")
    assert res.returncode == 0, res.stderr
    assert bad in res.stdout and "capture_incomplete (missing_token_ids)" in res.stdout
    line = one_line_error(cli("audit", "masked", "--db", db_url, "--reason", "bogus"))
    assert "unknown reason 'bogus'" in line and "missing_token_ids" in line


def test_audit_list_filters_by_state_and_relative_time_and_never_truncates(
    db_url: str, rid: Rid
) -> None:
    """Point 11: --state open, --since 1h, one timestamp format, full ids when piped."""
    long_id = rid("a-rather-long-rollout-identifier-that-would-not-fit-in-a-narrow-column")

    async def go() -> None:
        led = Ledger(db_url)
        try:
            await tool_loop(Scripted(led, long_id), 1)
        finally:
            await led.close()

    asyncio.run(go())
    res = cli(
        "audit", "list", "--db", db_url, "--state", "open", "--since", "1h", "--limit", "5000"
    )
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if long_id in x)  # whole id, one line
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", line), line
    assert "…" not in res.stdout
    data = json.loads(
        cli("audit", "list", "--db", db_url, "--state", "open", "--json", "--limit", "5000").stdout
    )
    (item,) = [i for i in data if i["rollout_id"] == long_id]
    assert item["state"] == "open"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", item["updated_at"])
    future = cli("audit", "list", "--db", db_url, "--since", "2999-01-01T00:00:00Z", "--json")
    assert json.loads(future.stdout) == []


def test_audit_stats_prints_no_empty_histogram_rows(db_url: str, rid: Rid, tmp_path: Path) -> None:
    ids = setup_rollouts(db_url, rid, 1)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [result_for(r) for r in ids])
    assert cli("collect", "--db", db_url, "-i", str(src), "-o", str(dst)).returncode == 0
    res = cli("audit", "stats", "--db", db_url)
    assert res.returncode == 0, res.stderr
    rows = [x for x in res.stdout.splitlines() if "delivered_fraction_histogram" in x]
    assert rows and all(not re.search(r"│\s+0\s+│", x) for x in rows), res.stdout
