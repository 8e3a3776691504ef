"""Issue #2 point 10: concurrency and durability, on SQLite and Postgres.

Every test runs on both backends.  Writers are asyncio tasks on several ``Ledger`` instances
(separate engines and pools) in this process, and OS processes running ``tests/helpers/writer.py``.

- many writers, nothing lost or duplicated: ``test_concurrent_writers_across_instances_and_…``
  (and ``test_refused_writes_racing_puts_…``: refusals mixed into the same commits);
- freeze racing puts: ``test_freeze_racing_puts_leaves_no_record_after_the_snapshot``;
- concurrent retires: ``test_concurrent_retires_from_two_instances_…`` and ``…_two_processes_…``;
- a SIGKILLed writer: ``test_sigkilled_writer_loses_no_acknowledged_call``;
- SQLite shared by processes: on the ``sqlite`` parameter, every process in the tests above
  opens the same database file as this one (the writer gets ``db_url`` verbatim), so those
  tests are that proof.

Synchronisation is by readiness lines, a ``go`` line on the workers' stdin, asyncio events and
deadlines; nothing sleeps.  Records are deterministic (``stream_record``), so "byte-for-byte"
means: the JSON of each frozen entry equals the JSON of the record that was put.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import sys
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from ledger.errors import PayloadConflict, RolloutFrozen, RolloutRetired
from ledger.records import TokenEntry
from ledger.store import FrozenSnapshot, Ledger
from tests.helpers.writer import Stream, call_id, stream_record

Rid = Callable[[str], str]
ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 45.0  # upper bound on any single wait; a healthy run needs a small fraction


# --------------------------------------------------------------------------- worker processes


class Worker:
    """One ``tests.helpers.writer`` process: its stdout lines, read as they arrive."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.lines: list[str] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _next_line(self) -> str | None:
        assert self.proc.stdout is not None
        raw = await self.proc.stdout.readline()
        if not raw.endswith(b"\n"):
            return None  # EOF (a torn last line of a killed process is not an acknowledgement)
        line = raw.decode().rstrip("\n")
        self.lines.append(line)
        return line

    async def wait_for(self, predicate: Callable[[list[str]], bool], what: str) -> None:
        """Read lines until ``predicate(lines)`` holds, within the deadline."""
        async with asyncio.timeout(DEADLINE_S):
            while not predicate(self.lines):
                if await self._next_line() is None:
                    await self.proc.wait()
                    raise AssertionError(
                        f"writer {self.pid} exited ({self.proc.returncode}) before {what}; "
                        f"lines={self.lines[-5:]}; stderr:\n{self.stderr()}"
                    )

    async def ready(self) -> None:
        await self.wait_for(lambda lines: "ready" in lines, "'ready'")

    async def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        await self.proc.stdin.drain()

    async def finish(self) -> list[str]:
        """Read to EOF and require a clean exit; returns every line."""
        async with asyncio.timeout(DEADLINE_S):
            while await self._next_line() is not None:
                pass
            rc = await self.proc.wait()
        assert rc == 0 and self.lines[-1:] == ["done"], (
            f"writer {self.pid} exited {rc}; last lines {self.lines[-5:]}; stderr:\n{self.stderr()}"
        )
        return self.lines

    async def kill(self) -> list[str]:
        """SIGKILL the process, then collect every line it had already written."""
        self.proc.send_signal(signal.SIGKILL)
        async with asyncio.timeout(DEADLINE_S):
            while await self._next_line() is not None:
                pass
            rc = await self.proc.wait()
        assert rc == -signal.SIGKILL, f"writer {self.pid} exited {rc} instead of being killed"
        return self.lines

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]


Spawn = Callable[[dict[str, Any]], Awaitable[Worker]]


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Spawn]:
    """Start writer processes; any still running at teardown is killed (by its own pid)."""
    started: list[Worker] = []

    async def start(spec: dict[str, Any]) -> Worker:
        err = tmp_path / f"writer-{len(started)}.stderr"
        with err.open("wb") as stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.helpers.writer",
                json.dumps(spec),
                cwd=ROOT,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
            )
        worker = Worker(proc, err)
        started.append(worker)
        return worker

    yield start
    for w in started:
        if w.proc.returncode is None:
            w.proc.kill()
            await w.proc.wait()


Ack = tuple[str, str, str, int]  # rollout id, call id, status, version


def parse_acks(lines: Iterable[str]) -> list[Ack]:
    out = []
    for line in lines:
        if line.startswith("ack "):
            _, rollout, call, status, version = line.split()
            out.append((rollout, call, status, int(version)))
    return out


def created_at_least(n: int) -> Callable[[list[str]], bool]:
    """A ``wait_for`` predicate: the worker has acknowledged ``n`` newly created records."""
    return lambda lines: sum(a[2] == "created" for a in parse_acks(lines)) >= n


# --------------------------------------------------------------------------- shared checks


def make_streams(rollouts: list[str], n: int, tag: str, seed0: int = 1) -> list[Stream]:
    """``n`` call streams spread round-robin over ``rollouts``, each with its own token range."""
    return [
        {"rollout_id": rollouts[i % len(rollouts)], "name": f"{tag}{i:02d}", "seed": seed0 + i}
        for i in range(n)
    ]


def expected_json(stream: Stream, k: int) -> str:
    return TokenEntry.model_validate(stream_record(stream, k)).model_dump_json()


def entries_json(snap: FrozenSnapshot) -> dict[str, str]:
    ids = [e.model_call_id for e in snap.entries]
    assert len(ids) == len(set(ids)), f"duplicate entries in the snapshot: {Counter(ids)}"
    return {e.model_call_id: e.model_dump_json() for e in snap.entries}


async def put_stream(led: Ledger, stream: Stream, calls: int, acks: list[Ack]) -> None:
    """Put a stream's first ``calls`` calls in order, noting each acknowledgement."""
    for k in range(calls):
        res = await led.put(stream_record(stream, k))
        acks.append((stream["rollout_id"], call_id(stream, k), res.status, res.version))


async def warm(led: Ledger) -> None:
    async with led.engine.connect() as conn:
        await conn.execute(sa.text("SELECT 1"))


async def table_counts(led: Ledger, rollout_id: str) -> dict[str, int]:
    queries = {
        "calls": "SELECT count(*) FROM calls WHERE rollout_id = :r",
        "captured": "SELECT count(*) FROM calls WHERE rollout_id = :r AND status = 'captured'",
        "call_tokens": "SELECT count(*) FROM call_tokens t JOIN calls c ON c.id = t.call_id "
        "WHERE c.rollout_id = :r",
        "lineage_edges": "SELECT count(*) FROM lineage_edges WHERE rollout_id = :r",
        "incomplete_events": "SELECT count(*) FROM incomplete_events WHERE rollout_id = :r",
    }
    async with led.engine.connect() as conn:
        return {
            name: (await conn.execute(sa.text(q), {"r": rollout_id})).scalar_one()
            for name, q in queries.items()
        }


async def assert_chains_proven(led: Ledger, rollout_id: str, streams: list[Stream]) -> None:
    """Every call after a stream's first was linked, by tokens, to the call before it."""
    views = {v.model_call_id: v for v in (await led.freeze_views(rollout_id)).calls}
    for s in streams:
        k = 0
        while (cid := call_id(s, k)) in views:
            want = call_id(s, k - 1) if k else None
            got = views[cid]
            assert got.parent_call_id == want, f"{cid}: parent {got.parent_call_id}, want {want}"
            assert got.edge_method == ("token_prefix" if k else None)
            k += 1


def sqlite_path(db_url: str) -> str | None:
    u = make_url(db_url)
    return u.database if u.get_backend_name() == "sqlite" else None


def assert_sqlite_intact(db_url: str) -> None:
    path = sqlite_path(db_url)
    if path is None:
        return
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        conn.close()


# --------------------------------------------------------------------------- 5. many writers


async def test_concurrent_writers_across_instances_and_processes_lose_nothing(
    db_url: str, rid: Rid, spawn: Spawn
) -> None:
    """8 tasks x 3 Ledger instances + 2 processes x 4 tasks put 96 calls into 3 rollouts.

    Every call is put twice, by two different writers (instances or processes) at once, so the
    byte-identical repeat races its original.  Afterwards: each call was acknowledged twice,
    created exactly once; versions per rollout are 1..n with no gaps or repeats; the frozen
    snapshot holds every call once, byte-for-byte; every token-prefix link was proven.
    """
    calls, n_streams = 6, 16
    rollouts = [rid("many") for _ in range(3)]
    streams = make_streams(rollouts, n_streams, "s")
    for s in streams:
        s["calls"] = calls
    # 32 writer slots (L = in-process Ledger instance, P = process).  Stream i runs at slot i
    # and at slot i + 16, which always belong to two different writers.
    owners = ["L0"] * 8 + ["L1"] * 8 + ["L2"] * 8 + ["P0"] * 4 + ["P1"] * 4
    plan: dict[str, list[Stream]] = defaultdict(list)
    for i, owner in enumerate(owners):
        plan[owner].append(streams[i % n_streams])
    assert all(a != b for a, b in zip(owners[:16], owners[16:], strict=True))

    procs = [
        await spawn({"db": db_url, "mode": "put", "wait_go": True, "streams": plan[p]})
        for p in ("P0", "P1")
    ]
    ledgers = [Ledger(db_url) for _ in range(3)]
    try:
        for led in ledgers:
            await warm(led)
        for w in procs:
            await w.ready()
        go = asyncio.Event()
        local_acks: list[Ack] = []

        async def run(led: Ledger, stream: Stream) -> None:
            await go.wait()
            await put_stream(led, stream, calls, local_acks)

        tasks = [
            asyncio.create_task(run(ledgers[int(owner[1])], stream))
            for owner in ("L0", "L1", "L2")
            for stream in plan[owner]
        ]
        assert len(tasks) == 24
        for w in procs:
            await w.go()
        go.set()
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.gather(*tasks)
        proc_acks = [parse_acks(await w.finish()) for w in procs]
    finally:
        for led in ledgers:
            await led.close()

    # Both processes really wrote (on SQLite: to the same file as this process).
    for w, acks in zip(procs, proc_acks, strict=True):
        assert len(acks) == 4 * calls, f"process {w.pid} acknowledged {len(acks)} puts"
    acks = local_acks + [a for pa in proc_acks for a in pa]
    assert len(acks) == 2 * n_streams * calls

    statuses: dict[str, list[str]] = defaultdict(list)
    created_version: dict[str, int] = {}
    for _, cid, status, version in acks:
        statuses[cid].append(status)
        if status == "created":
            created_version[cid] = version
    assert {cid: sorted(s) for cid, s in statuses.items()} == {
        call_id(s, k): ["created", "duplicate"] for s in streams for k in range(calls)
    }
    for _, cid, status, version in acks:
        if status == "duplicate":
            assert version >= created_version[cid], f"{cid}: duplicate saw an older version"

    check = Ledger(db_url)
    try:
        for r in rollouts:
            mine = [s for s in streams if s["rollout_id"] == r]
            n = calls * len(mine)
            versions = sorted(v for rr, _, st, v in acks if rr == r and st == "created")
            assert versions == list(range(1, n + 1)), f"{r}: created versions {versions}"
            assert (await check.get_state(r)).version == n
            assert await table_counts(check, r) == {
                "calls": n,
                "captured": n,
                "call_tokens": n,
                "lineage_edges": n - len(mine),
                "incomplete_events": 0,
            }
            snap = await check.freeze(r)
            assert not snap.incomplete and snap.version == n + 1
            assert entries_json(snap) == {
                call_id(s, k): expected_json(s, k) for s in mine for k in range(calls)
            }
            order = [e.model_call_id for e in snap.entries]
            for s in mine:
                own = [c for c in order if c.startswith(f"{s['name']}-")]
                assert own == [call_id(s, k) for k in range(calls)], "a stream's calls reordered"
            await assert_chains_proven(check, r, mine)
    finally:
        await check.close()
    assert_sqlite_intact(db_url)


async def test_refused_writes_racing_puts_change_nothing_and_lose_nothing(
    db_url: str, rid: Rid
) -> None:
    """Refusals interleaved with good puts on the same Ledger instances (on SQLite, in the same
    group commits): the refused writes change only what they promise to, the good ones all land.

    While 6 streams put 30 calls into rollout A, other tasks on the same instances re-send B's
    call ids with other bytes (each refused, each marking B incomplete, the first records kept),
    put into frozen rollout C (refused, C's snapshot unchanged) and into retired rollout D
    (refused, no row added).
    """
    a, b, c, d = rid("good"), rid("conflict"), rid("frozen"), rid("retired")
    good = make_streams([a], 6, "g", seed0=200)
    sb, sc, sd = make_streams([b, c, d], 3, "x", seed0=250)
    ledgers = [Ledger(db_url) for _ in range(2)]
    try:
        setup = ledgers[0]
        for k in range(4):
            await setup.put(stream_record(sb, k))
            await setup.put(stream_record(sc, k))
            await setup.put(stream_record(sd, k))
        b_version = (await setup.get_state(b)).version
        c_snap = await setup.freeze(c)
        d_snap = await setup.freeze(d)
        assert await setup.retire(d, snapshot_id=d_snap.snapshot_id, version=d_snap.version)
        for led in ledgers:
            await warm(led)

        go = asyncio.Event()
        acks: list[Ack] = []

        async def refused(led: Ledger, record: dict[str, Any], error: type[Exception]) -> None:
            await go.wait()
            with pytest.raises(error):
                await led.put(record)

        def other_bytes(k: int) -> dict[str, Any]:
            rec = stream_record(sb, k)
            rec["generation_log_probs"] = [x - 1.0 for x in rec["generation_log_probs"]]
            return rec

        async def run(led: Ledger, stream: Stream) -> None:
            await go.wait()
            await put_stream(led, stream, 5, acks)

        tasks = [asyncio.create_task(run(ledgers[i % 2], s)) for i, s in enumerate(good)]
        for k in range(4):
            led = ledgers[k % 2]
            tasks.append(asyncio.create_task(refused(led, other_bytes(k), PayloadConflict)))
            tasks.append(asyncio.create_task(refused(led, stream_record(sc, 4 + k), RolloutFrozen)))
            tasks.append(
                asyncio.create_task(refused(led, stream_record(sd, 4 + k), RolloutRetired))
            )
        go.set()
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.gather(*tasks)

        check = Ledger(db_url)
        try:
            assert sorted(v for *_, v in acks) == list(range(1, 31))
            snap = await check.freeze(a)
            assert entries_json(snap) == {
                call_id(s, k): expected_json(s, k) for s in good for k in range(5)
            }
            b_snap = await check.freeze(b)
            assert b_snap.incomplete and b_snap.version == b_version + 4 + 1
            assert entries_json(b_snap) == {call_id(sb, k): expected_json(sb, k) for k in range(4)}
            assert (await table_counts(check, b))["incomplete_events"] == 4
            c_again = await check.freeze(c)
            assert (c_again.snapshot_id, c_again.version) == (c_snap.snapshot_id, c_snap.version)
            assert entries_json(c_again) == entries_json(c_snap)
            d_state = await check.get_state(d)
            assert (d_state.state, d_state.version) == ("retired", d_snap.version)
            assert (await table_counts(check, d))["calls"] == 4
        finally:
            await check.close()
    finally:
        for led in ledgers:
            await led.close()


# --------------------------------------------------------------------------- 6. freeze race


async def test_freeze_racing_puts_leaves_no_record_after_the_snapshot(
    db_url: str, rid: Rid, spawn: Spawn
) -> None:
    """Puts from 2 instances x 4 tasks and a process race one freeze on the same rollout.

    Every put either returned success and its record is in the snapshot, byte-for-byte, or
    raised ``RolloutFrozen`` and nothing of it was stored; a later freeze returns the identical
    entries, snapshot id and version.
    """
    calls = 999  # streams run until the freeze refuses them; this only bounds a broken freeze
    r = rid("race")
    streams = make_streams([r], 10, "f", seed0=100)
    for s in streams:
        s["calls"] = calls
    local_streams, proc_streams = streams[:8], streams[8:]
    worker = await spawn({"db": db_url, "mode": "put", "wait_go": True, "streams": proc_streams})
    writers = [Ledger(db_url) for _ in range(2)]
    freezer = Ledger(db_url)
    acks: list[Ack] = []
    refused: list[str] = []
    try:
        for led in [*writers, freezer]:
            await warm(led)
        await worker.ready()
        go, enough = asyncio.Event(), asyncio.Event()

        async def run(led: Ledger, stream: Stream) -> None:
            await go.wait()
            for k in range(calls):
                try:
                    res = await led.put(stream_record(stream, k))
                except RolloutFrozen:
                    refused.append(call_id(stream, k))
                    return
                acks.append((r, call_id(stream, k), res.status, res.version))
                if len(acks) >= 12:
                    enough.set()

        async def freeze_midstream() -> FrozenSnapshot:
            await enough.wait()
            return await freezer.freeze(r)

        tasks = [asyncio.create_task(run(writers[i % 2], s)) for i, s in enumerate(local_streams)]
        freeze_task = asyncio.create_task(freeze_midstream())
        await worker.go()
        go.set()
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.gather(*tasks)
            snap = await freeze_task
        lines = await worker.finish()
        again = await freezer.freeze(r)
        counts = await table_counts(freezer, r)
    finally:
        for led in [*writers, freezer]:
            await led.close()

    acks += parse_acks(lines)
    refused += [line.split()[2] for line in lines if line.startswith("frozen ")]
    assert all(a[2] == "created" for a in acks)
    assert len(refused) == len(streams), "every stream must end at the freeze, not before it"
    acked = {a[1] for a in acks}
    assert not acked & set(refused)
    # Acknowledged == in the snapshot, exactly, byte for byte.
    by_id = {call_id(s, k): (s, k) for s in streams for k in range(calls)}
    assert entries_json(snap) == {c: expected_json(*by_id[c]) for c in acked}
    assert sorted(a[3] for a in acks) == list(range(1, len(acks) + 1))
    assert snap.version == len(acks) + 1 and not snap.incomplete
    # Each stream stopped at its first refusal: acknowledged calls 0..m-1, refused call m.
    for s in streams:
        m = sum(1 for c in acked if c.startswith(f"{s['name']}-"))
        assert {c for c in acked if c.startswith(f"{s['name']}-")} == {
            call_id(s, k) for k in range(m)
        }
        assert call_id(s, m) in refused
    # Nothing stored after the snapshot.
    assert counts["calls"] == counts["call_tokens"] == len(acked)
    assert (again.snapshot_id, again.version, again.incomplete) == (
        snap.snapshot_id,
        snap.version,
        snap.incomplete,
    )
    assert [e.model_dump_json() for e in again.entries] == [
        e.model_dump_json() for e in snap.entries
    ]
    assert_sqlite_intact(db_url)


# --------------------------------------------------------------------------- 7. retire races


async def _frozen_rollouts(led: Ledger, rid: Rid, n: int, tag: str) -> list[FrozenSnapshot]:
    snaps: list[FrozenSnapshot] = []
    for i, stream in enumerate(make_streams([rid(tag) for _ in range(n)], n, tag, seed0=300)):
        await led.put(stream_record(stream, 0))
        await led.put(stream_record(stream, 1))
        assert i == len(snaps)
        snaps.append(await led.freeze(stream["rollout_id"]))
    return snaps


async def _assert_retired_once(led: Ledger, snap: FrozenSnapshot) -> None:
    state = await led.get_state(snap.rollout_id)
    assert (state.state, state.snapshot_id, state.version) == (
        "retired",
        snap.snapshot_id,
        snap.version,
    )
    counts = await table_counts(led, snap.rollout_id)
    assert counts["calls"] == 2 and counts["call_tokens"] == 0  # tombstone kept, tokens gone


async def test_concurrent_retires_from_two_instances_exactly_one_wins(
    db_url: str, rid: Rid
) -> None:
    """Two Ledger instances (two engines, two pools) retire 8 snapshot identities at once."""
    a, b = Ledger(db_url), Ledger(db_url)
    try:
        await warm(a)
        await warm(b)
        snaps = await _frozen_rollouts(a, rid, 8, "ret")

        async def both(s: FrozenSnapshot) -> list[str]:
            outcomes = await asyncio.gather(
                a.retire_outcome(s.rollout_id, snapshot_id=s.snapshot_id, version=s.version),
                b.retire_outcome(s.rollout_id, snapshot_id=s.snapshot_id, version=s.version),
            )
            return [o.status for o in outcomes]

        async with asyncio.timeout(DEADLINE_S):
            results = await asyncio.gather(*(both(s) for s in snaps))
        # One retires; the other finds it retired at exactly that identity (a repeat: True).
        assert [sorted(r) for r in results] == [["repeat", "retired"]] * len(snaps)
        for s in snaps:
            await _assert_retired_once(b, s)
    finally:
        await a.close()
        await b.close()


async def test_concurrent_retires_from_two_processes_exactly_one_wins(
    db_url: str, rid: Rid, spawn: Spawn
) -> None:
    """Two OS processes (on SQLite: on one file) retire the same 8 snapshot identities at once."""
    led = Ledger(db_url)
    try:
        snaps = await _frozen_rollouts(led, rid, 8, "pret")
        targets = [
            {"rollout_id": s.rollout_id, "snapshot_id": s.snapshot_id, "version": s.version}
            for s in snaps
        ]
        spec = {"db": db_url, "mode": "retire", "wait_go": True, "targets": targets}
        procs = [await spawn(spec), await spawn(spec)]
        for w in procs:
            await w.ready()
        for w in procs:
            await w.go()
        outcomes: dict[str, list[str]] = defaultdict(list)
        for w in procs:
            for line in await w.finish():
                if line.startswith("retired "):
                    _, rollout, ok = line.split()
                    outcomes[rollout].append(ok)
        assert {k: sorted(v) for k, v in outcomes.items()} == {
            s.rollout_id: ["repeat", "retired"] for s in snaps
        }
        for s in snaps:
            await _assert_retired_once(led, s)
    finally:
        await led.close()


# --------------------------------------------------------------------------- 8. SIGKILL


def _stream_of(streams: list[Stream], cid: str) -> Stream:
    return next(s for s in streams if cid.startswith(f"{s['name']}-"))


async def _assert_nothing_torn(db_url: str, streams: list[Stream], acked: set[str]) -> None:
    """What a fresh Ledger sees after a crash: every acknowledged call, nothing half-written.

    Streams write in order, so each has acknowledged calls ``0 .. p-1``; only call ``p`` (the one
    in flight) may exist beyond that, as an intent or as a complete record whose acknowledgement
    never got out.  Every captured call has its token row; no rollout is marked incomplete.
    """
    assert_sqlite_intact(db_url)
    in_flight = set()
    for s in streams:
        p = sum(1 for c in acked if _stream_of(streams, c) is s)
        assert {c for c in acked if _stream_of(streams, c) is s} == {
            call_id(s, k) for k in range(p)
        }, f"stream {s['name']} acknowledged out of order"
        in_flight.add(call_id(s, p))
    fresh = Ledger(db_url)
    try:
        for r in sorted({s["rollout_id"] for s in streams}):
            async with fresh.engine.connect() as conn:
                rows = (
                    await conn.execute(
                        sa.text(
                            "SELECT c.model_call_id, c.status, t.call_id IS NOT NULL AS has_tokens"
                            " FROM calls c LEFT JOIN call_tokens t ON t.call_id = c.id"
                            " WHERE c.rollout_id = :r"
                        ),
                        {"r": r},
                    )
                ).all()
            torn = [row for row in rows if bool(row.has_tokens) != (row.status == "captured")]
            assert not torn, f"half-written calls visible after the crash: {torn}"
            captured = {row.model_call_id for row in rows if row.status == "captured"}
            intents = {row.model_call_id for row in rows if row.status == "intent"}
            mine = {c for c in acked if _stream_of(streams, c)["rollout_id"] == r}
            assert mine <= captured, f"acknowledged calls lost: {sorted(mine - captured)}"
            assert captured - mine <= in_flight and intents <= in_flight
            if not rows:
                continue  # none of this rollout's writes had committed yet
            state = await fresh.get_state(r)
            assert state.state == "open" and not state.incomplete
            assert state.version == len(captured)
            assert (await table_counts(fresh, r))["incomplete_events"] == 0
    finally:
        await fresh.close()


@pytest.mark.slow
async def test_sigkilled_writer_loses_no_acknowledged_call(
    db_url: str, rid: Rid, spawn: Spawn
) -> None:
    """A process streaming puts is SIGKILLed mid-stream, three times, then run to completion.

    Six streams over three rollouts; half register an intent (``begin_call``) before each put,
    half put directly, so both ways a record lands are cut.  Each run re-sends every stream from
    its first call.  After each kill a fresh Ledger sees every acknowledged call and nothing torn
    (``_assert_nothing_torn``); every call acknowledged by an earlier run comes back as a
    byte-identical duplicate; the final freeze is complete and equal, byte for byte, to what was
    sent, with every token-prefix link proven.
    """
    rollouts = [rid("kill") for _ in range(3)]
    streams = make_streams(rollouts, 6, "k", seed0=500)
    for i, s in enumerate(streams):
        s["intents"] = i % 2 == 0
    spec = {"db": db_url, "mode": "put", "streams": streams}
    acked: set[str] = set()
    # Kill after a number of new records that is not a multiple of the six streams, so the
    # signal lands while some streams are mid-transaction.
    for new_records in (27, 21, 15):
        for s in streams:
            s["calls"] = 400  # far more than a run gets through before its kill
        writer = await spawn(spec)
        await writer.wait_for(created_at_least(new_records), f"{new_records} new records")
        lines = await writer.kill()
        assert "done" not in lines, "the writer finished before it was killed"
        run = parse_acks(lines)
        again = [(cid, status) for _, cid, status, _ in run if cid in acked]
        assert all(status == "duplicate" for _, status in again), again
        acked |= {cid for _, cid, _, _ in run}
        await _assert_nothing_torn(db_url, streams, acked)

    # Restart to completion: each stream up to two calls past what it had acknowledged.
    for s in streams:
        s["calls"] = sum(1 for c in acked if _stream_of(streams, c) is s) + 2
    run = parse_acks(await (await spawn(spec)).finish())
    assert len(run) == sum(s["calls"] for s in streams)
    assert all(status == "duplicate" for _, cid, status, _ in run if cid in acked)
    final = Ledger(db_url)
    try:
        for r in rollouts:
            mine = [s for s in streams if s["rollout_id"] == r]
            snap = await final.freeze(r)
            assert not snap.incomplete
            assert entries_json(snap) == {
                call_id(s, k): expected_json(s, k) for s in mine for k in range(s["calls"])
            }
            await assert_chains_proven(final, r, mine)
    finally:
        await final.close()
    assert_sqlite_intact(db_url)
