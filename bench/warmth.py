"""``python -m bench.warmth``: what the same small operation costs back to back and after a gap.

Inside ``rollout-ledger serve`` each stage of a captured call costs about three times what it
costs in a loop on its own (docs/performance.md).  A proxied call runs its stages between waits
(the intent, then the engine's milliseconds, then the record, then the flush), so each stage
starts after a gap.  This measures three operations, each p50 over ``--calls`` runs, back to back
and after a gap that either sleeps (the CPU goes idle) or spins (the CPU stays busy with a tight
loop that touches almost no memory):

- ``begin_call``: the intent through the ledger on a fresh SQLite file (one transaction on the
  event loop, no flush);
- ``sqlite3 txn``: a comparable transaction on a plain stdlib ``sqlite3`` connection (WAL,
  ``synchronous=NORMAL``): ``BEGIN IMMEDIATE``, one indexed read, one insert, ``COMMIT``;
- ``orjson 16k``: ``orjson.loads`` of a 16,000-id JSON array (C only, no system call).

The gap modes run in alternating rounds, so a drift of the machine spreads over all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

from ledger import migrate
from ledger.store import Ledger

__all__ = ["measure"]

Op = Callable[[], Awaitable[None]]


def _gap(seconds: float, mode: str) -> None:
    if mode == "sleep":
        time.sleep(seconds)
    elif mode == "spin":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


async def _p50(op: Op, calls: int, gap_s: float, mode: str) -> float:
    times = []
    for _ in range(calls):
        _gap(gap_s, mode)
        start = time.perf_counter()
        await op()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _plain_sqlite(path: Path) -> Op:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("CREATE TABLE IF NOT EXISTS r (id TEXT PRIMARY KEY, state TEXT)")
    conn.execute("CREATE TABLE IF NOT EXISTS c (rid TEXT, cid TEXT, route TEXT, model TEXT)")
    conn.execute("CREATE INDEX IF NOT EXISTS c_rid ON c (rid)")
    conn.execute("INSERT OR IGNORE INTO r VALUES ('r', 'open')")

    async def op() -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("SELECT state FROM r WHERE id = ?", ("r",)).fetchone()
        conn.execute(
            "INSERT INTO c VALUES (?, ?, ?, ?)",
            ("r", uuid.uuid4().hex, "POST /v1/chat/completions", "m"),
        )
        conn.execute("COMMIT")

    return op


async def measure(calls: int, gaps_ms: list[float], rounds: int) -> dict[str, dict[str, float]]:
    """p50 ms per operation and gap mode (``"back to back"``, ``"sleep N ms"``, ``"spin N ms"``),
    the median over ``rounds`` alternating rounds."""
    with tempfile.TemporaryDirectory(prefix="rl-warmth-") as tmp:
        url = f"sqlite+aiosqlite:///{Path(tmp) / 'ledger.db'}"
        migrate.upgrade(url)
        ledger = Ledger(url)
        rollout = f"warmth-{uuid.uuid4().hex[:8]}"
        answer = orjson.dumps(list(range(100_000, 116_000)))

        async def intent() -> None:
            await ledger.begin_call(
                rollout, uuid.uuid4().hex, route="POST /v1/chat/completions", model="m"
            )

        async def parse() -> None:
            orjson.loads(answer)

        ops: dict[str, Op] = {
            "begin_call": intent,
            "sqlite3 txn": _plain_sqlite(Path(tmp) / "plain.db"),
            "orjson 16k": parse,
        }
        modes = [("back to back", 0.0, "")]
        for gap in gaps_ms:
            modes += [
                (f"sleep {gap:g} ms", gap / 1e3, "sleep"),
                (f"spin {gap:g} ms", gap / 1e3, "spin"),
            ]
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in ops}
        try:
            for op in ops.values():  # warm-up: first pages, caches, the writer's connection
                await _p50(op, 20, 0.0, "")
            for _ in range(rounds):
                for label, gap_s, mode in modes:
                    for name, op in ops.items():
                        value = await _p50(op, calls, gap_s, mode)
                        samples[name].setdefault(label, []).append(value)
        finally:
            await ledger.close()
    return {
        name: {label: statistics.median(values) for label, values in by_mode.items()}
        for name, by_mode in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.warmth", description=__doc__)
    parser.add_argument("--calls", type=int, default=200, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument(
        "--gap-ms", type=float, action="append", help="gap before each call (repeatable; 2, 10)"
    )
    args = parser.parse_args()
    gaps = args.gap_ms or [2.0, 10.0]
    result = asyncio.run(measure(args.calls, gaps, args.rounds))
    labels = list(next(iter(result.values())))
    print("| operation | " + " | ".join(labels) + " |")
    print("| --- |" + " --- |" * len(labels))
    for name, by_mode in result.items():
        base = by_mode["back to back"]
        cells = [f"{by_mode[label]:.3f} ({by_mode[label] / base:.1f}x)" for label in labels]
        print(f"| {name} (p50 ms) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
