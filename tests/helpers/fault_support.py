"""Shared machinery of the fault, fuzz and soak tests (issue #5 points 4 to 6).

- :class:`UpstreamTap`: an ASGI wrapper around the simulated vLLM that keeps every generating
  answer as it crossed the wire (``answers``, by response id; ``capture_answers``, the proxy's
  capture requests in order), can hold a request at a gate
  until the test opens it, and can cut an answer's body half-way and drop the connection.
- :class:`ServeProcess`: ``rollout-ledger serve`` as a real OS process on a loopback port, with
  readiness polled against a deadline, SIGKILL, and its RSS.
- :class:`PrivatePostgres`: a throw-away Postgres cluster from the local binaries (``initdb`` +
  ``pg_ctl``) on a free port, that a test may stop and start at will (the machine's shared
  cluster is never touched).
- ``ledger_*`` helpers: read the ledger directly (row counts, half-written calls, frozen
  entries) for the byte-for-byte comparisons.

Nothing sleeps blindly: every wait is a poll with a deadline or a bounded wait on an event or
a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from ledger.store import Ledger
from ledger.tables import Base
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
GENERATING_PATHS = ("/v1/chat/completions", "/v1/completions")

Scope = dict[str, Any]
Message = dict[str, Any]


# --------------------------------------------------------------------------- small utilities


def poll(
    predicate: Callable[[], bool], *, deadline_s: float, what: str, step_s: float = 0.02
) -> None:
    """Wait until ``predicate()`` holds; fail with ``what`` after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    wake = threading.Event()  # never set: a bounded wait between checks, not a fixed sleep
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        wake.wait(step_s)


class _Cut(Exception):
    """Raised inside the tap to make uvicorn drop a connection mid-body."""


# --------------------------------------------------------------------------- upstream tap


def _asks_for_ids(body: bytes) -> bool:
    """A capture request (the proxy asked for token ids), not a harness's own body."""
    try:
        sent = json.loads(body)
    except ValueError:
        return False
    return isinstance(sent, dict) and sent.get("return_token_ids") is True


@dataclass
class TapRecord:
    path: str
    marker: str | None
    status: int
    body: bytes
    # The request asked for token ids (the proxy's capture request, not a pass-through body).
    capture: bool = False

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class UpstreamTap:
    """Wraps an ASGI app (the sim engine's); see the module docstring."""

    app: Any
    records: list[TapRecord] = field(default_factory=list)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    cuts: dict[str, float] = field(default_factory=dict)
    arrived: list[str] = field(default_factory=list)  # markers of gated requests that arrived
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- test controls (thread-safe)

    def gate(self, marker: str) -> threading.Event:
        """Hold every generating request whose body contains ``marker`` until the event is set."""
        event = threading.Event()
        with self._lock:
            self.gates[marker] = event
        return event

    def cut(self, marker: str, fraction: float = 0.5) -> None:
        """Answer requests containing ``marker`` with the status line, the headers (the full
        ``content-length``) and ``fraction`` of the body, then drop the connection."""
        with self._lock:
            self.cuts[marker] = fraction

    def answers(self) -> dict[str, dict[str, Any]]:
        """Every 200 generating answer, by its ``id``."""
        with self._lock:
            recs = list(self.records)
        out: dict[str, dict[str, Any]] = {}
        for rec in recs:
            if rec.status == 200:
                body = rec.json()
                out[str(body["id"])] = body
        return out

    def capture_answers(self) -> list[dict[str, Any]]:
        """Every 200 answer to a capture request (token ids asked for), in the order sent."""
        with self._lock:
            recs = list(self.records)
        return [rec.json() for rec in recs if rec.status == 200 and rec.capture]

    def forget(self) -> None:
        """Drop what was recorded so far (a shared stack between tests)."""
        with self._lock:
            self.records.clear()

    def statuses(self, marker: str) -> list[int]:
        with self._lock:
            return [r.status for r in self.records if r.marker == marker]

    # ---- ASGI

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATING_PATHS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before the body arrived
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        marker = self._marker(body)
        capture = _asks_for_ids(body)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            message: Message = await receive()
            return message

        with self._lock:
            gate = self.gates.get(marker) if marker else None
            cut = self.cuts.get(marker) if marker else None
        if gate is not None:
            with self._lock:
                self.arrived.append(str(marker))
            opened = await asyncio.to_thread(gate.wait, 60.0)
            if not opened:
                raise RuntimeError(f"gate {marker!r} was never opened")
        status = 0
        parts: list[bytes] = []
        start: Message | None = None

        async def tapping_send(message: Message) -> None:
            nonlocal status, start
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if cut is not None:
                    start = message  # held until the whole body is known
                    return
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    with self._lock:
                        self.records.append(
                            TapRecord(scope["path"], marker, status, b"".join(parts), capture)
                        )
                    if cut is not None and start is not None:
                        whole = b"".join(parts)
                        await send(start)
                        await send(
                            {
                                "type": "http.response.body",
                                "body": whole[: int(len(whole) * cut)],
                                "more_body": True,
                            }
                        )
                        raise _Cut("tap: connection dropped mid-answer (fault injection)")
                if cut is not None:
                    return
            await send(message)

        await self.app(scope, replay, tapping_send)

    def _marker(self, body: bytes) -> str | None:
        with self._lock:
            names = list(self.gates) + list(self.cuts)
        text = body.decode("utf-8", errors="replace")
        return next((m for m in names if m in text), None)


# --------------------------------------------------------------------------- serve process


def cli_command() -> list[str]:
    """The installed ``rollout-ledger`` console script next to this interpreter."""
    script = Path(sys.executable).parent / "rollout-ledger"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from api.cli import main; main()"]


class ServeProcess:
    """``rollout-ledger serve --db URL --upstream URL --port P`` in its own OS process."""

    def __init__(
        self,
        db_url: str,
        upstream: str,
        workdir: Path,
        *,
        port: int | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.db_url = db_url
        self.upstream = upstream
        self.workdir = workdir
        self.port = port or free_port()
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"serve-{self.port}.log"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, *, deadline_s: float = 60.0) -> ServeProcess:
        cmd = [
            *cli_command(),
            "serve",
            "--db",
            self.db_url,
            "--upstream",
            self.upstream,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--log-level",
            "warning",
        ]
        if self.config is not None:
            import yaml

            cfg = self.workdir / f"serve-{self.port}.yaml"
            cfg.write_text(yaml.safe_dump(self.config))
            cmd += ["--config", str(cfg)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_LEDGER_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n==== start {self.starts}: {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        self.wait_ready(deadline_s=deadline_s)
        return self

    def wait_ready(self, *, deadline_s: float) -> None:
        assert self.proc is not None
        end = time.monotonic() + deadline_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"rollout-ledger serve exited ({self.proc.returncode}) during startup:\n"
                        + self.log_text()[-4000:]
                    )
                try:
                    if client.get(self.url + "/healthz").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > end:
                    raise AssertionError(
                        f"rollout-ledger serve not ready within {deadline_s:.0f} s:\n"
                        + self.log_text()[-4000:]
                    )
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.05)  # bounded wait that also notices an exit

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks, no flushes; what was committed is all there is."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)

    def rss(self) -> int:
        import psutil  # type: ignore[import-untyped,unused-ignore]

        return int(psutil.Process(self.pid).memory_info().rss)


# --------------------------------------------------------------------------- private Postgres


def postgres_bin() -> Path | None:
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: p.parent.name)
    for cand in reversed(candidates):
        if (cand / "initdb").exists() and (cand / "pg_ctl").exists():
            return cand
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).parent
    return None


class PrivatePostgres:
    """A Postgres cluster of this test only: initdb in a temp dir, a free loopback port."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="rl_h10_pg_"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.run_as: list[str] = []
        if os.geteuid() == 0:
            # initdb refuses to run as root: the cluster belongs to the postgres OS user.
            shutil.chown(self.dir, user="postgres")
            self.run_as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str, timeout: float = 120.0) -> None:
        cmd = [*self.run_as, *args]
        res = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        if res.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout.decode()}\n"
                f"{res.stderr.decode()}\n{self.log_text()[-3000:]}"
            )

    def log_text(self) -> str:
        try:
            return (self.dir / "log").read_text(errors="replace")
        except (FileNotFoundError, PermissionError):
            return ""

    def init(self) -> PrivatePostgres:
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
            "-E",
            "UTF8",
        )
        return self

    def start(self) -> None:
        opts = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=on "
            "-c max_connections=200"
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.dir / "log"),
            "-o",
            opts,
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, db: str) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{db}"

    def create_database(self, db: str) -> str:
        async def run() -> None:
            import asyncpg

            conn = await asyncpg.connect(self.admin_url())
            try:
                await conn.execute(f'CREATE DATABASE "{db}"')
            finally:
                await conn.close()

        asyncio.run(run())
        return self.url(db)

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    import pytest

    bindir = postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root without a 'postgres' OS user: initdb refuses root")
        if shutil.which("runuser") is None:
            pytest.skip("running as root without runuser to start Postgres as 'postgres'")
    pg = PrivatePostgres(bindir)
    try:
        pg.init().start()
        yield pg
    finally:
        pg.destroy()


# --------------------------------------------------------------------------- ledger reads


def run_async(coro_fn: Callable[[Ledger], Any], db_url: str) -> Any:
    async def run() -> Any:
        led = Ledger(db_url)
        try:
            return await coro_fn(led)
        finally:
            await led.close()

    return asyncio.run(run())


TABLES = [t.name for t in Base.metadata.sorted_tables]


async def table_counts(led: Ledger) -> dict[str, int]:
    out: dict[str, int] = {}
    async with led.engine.connect() as conn:
        for name in TABLES:
            table = Base.metadata.tables[name]
            out[name] = int(
                (await conn.execute(sa.select(sa.func.count()).select_from(table))).scalar_one()
            )
    return out


async def half_written(led: Ledger, rollout_ids: list[str] | None = None) -> list[tuple[str, str]]:
    """Captured calls without their tokens row, and token rows of calls that are not captured:
    either is a half-written record."""
    calls = Base.metadata.tables["calls"]
    tokens = Base.metadata.tables["call_tokens"]
    has_tokens = sa.exists().where(tokens.c.call_id == calls.c.id)
    broken = sa.or_(
        sa.and_(calls.c.status == "captured", ~has_tokens),
        sa.and_(calls.c.status != "captured", has_tokens),
    )
    query = sa.select(calls.c.rollout_id, calls.c.model_call_id).where(broken)
    if rollout_ids is not None:
        query = query.where(calls.c.rollout_id.in_(rollout_ids))
    async with led.engine.connect() as conn:
        return [(r.rollout_id, r.model_call_id) for r in (await conn.execute(query)).all()]


async def call_rows(led: Ledger, rollout_id: str) -> list[Any]:
    calls = Base.metadata.tables["calls"]
    async with led.engine.connect() as conn:
        return list(
            (
                await conn.execute(
                    sa.select(calls.c.model_call_id, calls.c.status, calls.c.response_id)
                    .where(calls.c.rollout_id == rollout_id)
                    .order_by(calls.c.id)
                )
            ).all()
        )


async def incomplete_reasons(led: Ledger, rollout_id: str) -> list[str]:
    events = Base.metadata.tables["incomplete_events"]
    async with led.engine.connect() as conn:
        return list(
            (
                await conn.execute(
                    sa.select(events.c.reason)
                    .where(events.c.rollout_id == rollout_id)
                    .order_by(events.c.id)
                )
            ).scalars()
        )


# --------------------------------------------------------------------------- comparisons


def sampled_tokens(answer: dict[str, Any]) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, generated ids, log-probs) of one upstream chat answer, as sampled."""
    choice = answer["choices"][0]
    prompt = answer.get("prompt_token_ids") or choice.get("prompt_token_ids")
    return (
        list(prompt),
        list(choice["token_ids"]),
        [float(c["logprob"]) for c in choice["logprobs"]["content"]],
    )


def same_floats(a: list[float], b: list[float]) -> bool:
    """Bit-exact equality (``-inf`` included; NaN never appears in a sampled answer)."""
    return len(a) == len(b) and all(x == y for x, y in zip(a, b, strict=True))


class LedgerThread:
    """One ``Ledger`` on an event loop of its own thread, for synchronous tests (hypothesis
    examples, worker threads) that read the ledger many times without re-connecting."""

    def __init__(self, db_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="ledger-loop", daemon=True
        )
        self.thread.start()
        self.ledger: Ledger = self._submit(self._open(db_url))

    @staticmethod
    async def _open(db_url: str) -> Ledger:
        return Ledger(db_url)

    def _submit(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def run(self, fn: Callable[[Ledger], Any]) -> Any:
        return self._submit(fn(self.ledger))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._submit(self.ledger.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@contextlib.contextmanager
def ledger_thread(db_url: str) -> Iterator[LedgerThread]:
    lt = LedgerThread(db_url)
    try:
        yield lt
    finally:
        lt.close()


# --------------------------------------------------------------------------- server-side errors


class ServerErrors(logging.Filter):
    """Collects the exceptions an in-process uvicorn logs ("Exception in ASGI application"),
    so a 500 seen by a client can be named by where it was raised.

    A filter on the ``uvicorn.error`` logger rather than a handler: uvicorn's logging config,
    applied whenever a server is configured, removes the logger's handlers but keeps filters.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[str] = []
        self._lock2 = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.exc_info and record.exc_info[1] is not None:
            with self._lock2:
                self.records.append(exception_signature(record.exc_info[1]))
        return True

    def since(self, n: int, *, wait_s: float = 2.0) -> list[str]:
        """Signatures logged after the first ``n``; waits briefly for the one a 500 implies
        (uvicorn logs it after the response went out)."""
        end = time.monotonic() + wait_s
        wake = threading.Event()
        while len(self.records) <= n and time.monotonic() < end:
            wake.wait(0.01)
        with self._lock2:
            return self.records[n:]

    @contextlib.contextmanager
    def attached(self) -> Iterator[ServerErrors]:
        logger = logging.getLogger("uvicorn.error")
        logger.addFilter(self)
        try:
            yield self
        finally:
            logger.removeFilter(self)


def exception_signature(exc: BaseException) -> str:
    """``Type at path:line`` of the innermost frame in this repository's own code."""
    tb = exc.__traceback__
    where = "?"
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename.startswith(str(ROOT)) and "/site-packages/" not in filename:
            where = f"{Path(filename).relative_to(ROOT)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{type(exc).__name__} at {where}: {str(exc)[:80]}"


async def rollouts_among(led: Ledger, rollout_ids: list[str]) -> list[str]:
    """Which of these rollout ids have a row (of any kind) in the ledger."""
    rollouts = Base.metadata.tables["rollouts"]
    out: list[str] = []
    async with led.engine.connect() as conn:
        for i in range(0, len(rollout_ids), 500):
            chunk = rollout_ids[i : i + 500]
            query = sa.select(rollouts.c.rollout_id).where(rollouts.c.rollout_id.in_(chunk))
            out += list((await conn.execute(query)).scalars())
    return out
