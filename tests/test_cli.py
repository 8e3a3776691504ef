"""The command line as a user meets it (issue 14 points 6, 11; issue 13 item 9).

Every test runs the real entry point (``python -m api.cli``, the console script's ``main``) in
a subprocess, with real SQLite files and the real Postgres.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PG_URL, require_postgres

ROOT = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LEDGER_")}
    env.update({"COLUMNS": "80", "NO_COLOR": "1"}, **extra)
    return env


def cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run ``rollout-ledger ARGS`` through the console script's entry point."""
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args],
        cwd=cwd or ROOT,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_http(url: str, proc: subprocess.Popen[str], deadline_s: float = 90) -> None:
    """Poll ``url`` until it answers (a readiness probe with a deadline, never a sleep)."""
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"process exited with {proc.returncode}: {out}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.05)  # bounded wait on the process, not a blind sleep
    raise AssertionError(f"{url} did not answer within {deadline_s} s")


class Served:
    """A ``rollout-ledger serve`` (or ``sim``) subprocess on a free loopback port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, probe: str = "/healthz"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "api.cli", *args, "--port", str(self.port)],
            cwd=ROOT,
            env=env or clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_http(self.url + probe, self.proc)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)


@pytest.fixture
def served() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for s in started:
        s.stop()


def one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode != 0, res
    assert "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


# --------------------------------------------------------------------------- shape of the CLI


def test_help_lists_commands_in_workflow_order_without_loading_the_database_layer() -> None:
    res = cli("--help")
    assert res.returncode == 0, res.stderr
    order = [name for name in ("serve", "sim", "demo", "collect", "audit", "db", "sweep")]
    positions = [res.stdout.index(f" {name} ") for name in order]
    assert positions == sorted(positions), res.stdout
    # What keeps --help fast: SQLAlchemy, the store and the web layer load only when a command
    # runs.  (A behaviour, not a stopwatch.)
    probe = (
        "import sys\n"
        "from ledger.cli_errors import run_cli\n"
        "from api.cli import app\n"
        "rc = run_cli(app, ['--help'])\n"
        "heavy = [m for m in ('sqlalchemy', 'fastapi', 'ledger.store', 'pydantic') "
        "if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_version() -> None:
    from importlib.metadata import version

    res = cli("--version")
    assert (
        res.returncode == 0 and res.stdout.strip() == f"rollout-ledger {version('rollout-ledger')}"
    )


def test_every_option_has_help_and_shows_its_default() -> None:
    import typer.main

    from api.cli import app

    root = typer.main.get_command(app)
    missing: list[str] = []

    def walk(cmd: Any, path: str) -> None:
        for sub_name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {sub_name}")
        if not cmd.help and path != "rollout-ledger":
            missing.append(f"{path}: no help text")
        for param in cmd.params:
            if param.name in ("help",) or param.param_type_name == "argument":
                continue
            if not param.help:
                missing.append(f"{path} {param.opts[0]}: no help")

    walk(root, "rollout-ledger")
    assert missing == []
    res = cli("collect", "--help", env=clean_env(COLUMNS="300"))
    assert "default: 8" in res.stdout.replace("[", "").replace("]", "")
    assert "else 0.5" in res.stdout


# --------------------------------------------------------------------------- one-line errors


def test_ordinary_mistakes_are_one_line_errors_and_debug_shows_the_traceback(
    tmp_path: Path,
) -> None:
    cases: list[tuple[list[str], str]] = [
        (["audit", "stats", "--db", "sqlite+aiosqlite:///missing.db"], "no ledger at"),
        (["audit", "stats", "--db", "mysql://u@h/db"], "unsupported database URL"),
        (["audit", "stats", "--db", "ledger.db"], "is not a database URL"),
        (
            ["db", "upgrade", "--db", f"sqlite+aiosqlite:///{tmp_path}/no/such/dir/x.db"],
            "does not exist",
        ),
        (
            ["db", "upgrade", "--db", f"sqlite+aiosqlite:///{tmp_path}/x.db", "--revision", "9999"],
            "unknown schema revision '9999'",
        ),
        (["serve", "--log-level", "loud"], "--log-level must be one of"),
        (["audit", "stats", "--db", "postgresql://postgres@127.0.0.1:1/none"], "database"),
        (["sweep", "--db", "sqlite+aiosqlite:///missing.db"], "no ledger at"),
        (["db", "current", "--db", "sqlite+aiosqlite:///missing.db"], "no ledger at"),
        (["audit", "list", "--since", "yesterday"], "--since 'yesterday'"),
        (["collect", "-i", "nope.jsonl", "-o", "out.jsonl"], "input file nope.jsonl"),
        (["frobnicate"], "No such command"),
        (["collect"], "Missing option"),
    ]
    for args, needle in cases:
        line = one_line_error(cli(*args, cwd=tmp_path))
        assert needle in line, (args, line)
    debug = cli("--debug", "audit", "stats", "--db", "sqlite+aiosqlite:///missing.db", cwd=tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "NoLedger" in debug.stderr
    debug_after = cli("audit", "stats", "--db", "sqlite+aiosqlite:///m.db", "--debug", cwd=tmp_path)
    assert "Traceback" in debug_after.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no ledger file was created


def test_passwords_never_appear_in_errors(tmp_path: Path) -> None:
    res = cli("audit", "stats", "--db", "postgresql://me:s3cret@127.0.0.1:1/x", cwd=tmp_path)
    assert "s3cret" not in res.stderr + res.stdout
    one_line_error(res)


def test_a_second_demo_on_the_same_database_works(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'demo.db'}"
    assert cli("db", "upgrade", "--db", db).returncode == 0
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    for _ in range(2):
        res = cli("demo", "--db", db, env=clean_env(COLUMNS="200", TMPDIR=str(scratch)))
        assert res.returncode == 0, res.stderr[-2000:]
        assert "delivered" in res.stdout
    assert list(scratch.iterdir()) == []  # each run removed its temporary directory
    # Without --db the ledger lives in that temporary directory and goes with it.
    res = cli("demo", env=clean_env(COLUMNS="200", TMPDIR=str(scratch)), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert list(scratch.iterdir()) == []


# --------------------------------------------------------------------------- read-only commands


@pytest.fixture
def empty_postgres() -> Iterator[str]:
    """A fresh, empty Postgres database (no ledger in it), dropped afterwards."""
    base = require_postgres()
    name = f"rl_empty_{uuid.uuid4().hex[:10]}"

    async def admin(sql: str) -> None:
        import asyncpg

        dsn = PG_URL.replace("postgresql+asyncpg://", "postgresql://")
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    url = base.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def _pg_tables(url: str) -> list[str]:
    import asyncpg

    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        rows = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY 1"
        )
    finally:
        await conn.close()
    return [r["tablename"] for r in rows]


READ_ONLY = [
    ["audit", "stats"],
    ["audit", "list"],
    ["audit", "masked"],
    ["audit", "show", "r-1"],
    ["sweep"],
    ["db", "current"],
]


def test_read_only_commands_never_create_a_sqlite_ledger(tmp_path: Path) -> None:
    db = tmp_path / "absent.db"
    for args in READ_ONLY:
        line = one_line_error(cli(*args, "--db", f"sqlite+aiosqlite:///{db}", cwd=tmp_path))
        assert f"no ledger at {db}" in line and "db upgrade" in line
    src = tmp_path / "in.jsonl"
    src.write_text('{"_ng_rollout_id": "r-1"}\n')
    line = one_line_error(
        cli(
            "collect",
            "--db",
            f"sqlite+aiosqlite:///{db}",
            "-i",
            str(src),
            "-o",
            "out.jsonl",
            cwd=tmp_path,
        )
    )
    assert "no ledger at" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.postgres
def test_read_only_commands_never_create_tables_in_postgres(empty_postgres: str) -> None:
    for args in READ_ONLY:
        line = one_line_error(cli(*args, "--db", empty_postgres))
        assert "no ledger at" in line
    assert asyncio.run(_pg_tables(empty_postgres)) == []
    assert cli("db", "upgrade", "--db", empty_postgres).returncode == 0
    assert "rollouts" in asyncio.run(_pg_tables(empty_postgres))


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_gym_clients_from_a_database_url_never_create_a_ledger(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from ledger.errors import NoLedger
    from ledger.gym import CaptureSink, CaptureSource

    if backend == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'none.db'}"
    else:
        url = request.getfixturevalue("empty_postgres")

    async def use() -> None:
        sink, source = CaptureSink(url=url), CaptureSource(url=url)
        try:
            with pytest.raises(NoLedger, match="no ledger at"):
                await sink.mark_incomplete("r-1", reason="capture_failed")
            with pytest.raises(NoLedger, match="no ledger at"):
                await source.freeze("r-1")
        finally:
            await sink.close()
            await source.close()

    asyncio.run(use())
    if backend == "sqlite":
        assert list(tmp_path.iterdir()) == []
    else:
        assert asyncio.run(_pg_tables(url)) == []


def test_serve_creates_the_ledger_but_not_with_no_migrate(tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'l.db'}"
    line = one_line_error(cli("serve", "--db", db, "--no-migrate", "--port", str(free_port())))
    assert "no ledger at" in line
    assert not (tmp_path / "l.db").exists()


def test_the_cli_default_database_is_the_engine_default() -> None:
    import ledger.cli
    import ledger.cli_ops
    from ledger.engine import DEFAULT_DB_URL

    assert ledger.cli.DEFAULT_DB_URL == ledger.cli_ops.DEFAULT_DB_URL == DEFAULT_DB_URL


def test_conformance_deletes_the_rollouts_it_wrote(db_url: str) -> None:
    """Issue 14 point 12: the kit leaves the ledger it checks as it found it."""
    import json

    def ids() -> set[str]:
        res = cli("audit", "list", "--db", db_url, "--json", "--limit", "100000")
        assert res.returncode == 0, res.stderr
        return {i["rollout_id"] for i in json.loads(res.stdout)}

    before = ids()
    res = cli("conformance", "--db", db_url)
    assert res.returncode == 0, res.stderr
    assert "checks passed" in res.stdout
    assert {r for r in ids() - before if r.startswith("conformance-")} == set()
