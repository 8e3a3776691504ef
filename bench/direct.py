"""In-process runners: ingest through the Ledger API (``begin_call`` + ``put`` per call, as the
proxy does), storage accounting, and freeze + build + projection per rollout."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from bench.dbs import Db
from bench.stats import summarize
from bench.variants import TimedLedger
from bench.workload import DirectCall, Workload, direct_calls, distinct_token_stats
from ledger.delivery import finalize_rollout_token_capture
from ledger.store import Ledger

__all__ = [
    "by_turn",
    "finalize_all",
    "ingest",
    "raw_sizes",
    "rollout_result",
    "size_snapshot",
    "storage",
]

ROUTE = "POST /v1/chat/completions"


async def ingest(
    ledger: Ledger,
    w: Workload,
    *,
    prefix: str,
    concurrency: int | None = None,
    keep_calls: bool = False,
) -> dict[str, Any]:
    """Run ``w.rollouts`` rollouts, ``concurrency`` at a time (default: all at once), each one's
    calls in order.  Per call: ``begin_call`` (the intent) then ``put`` (the record); the call
    counts as acknowledged when ``put`` returns (both are durable commits)."""
    concurrency = concurrency or w.rollouts
    sem = asyncio.Semaphore(concurrency)
    samples: list[dict[str, Any]] = []
    per_rollout: dict[str, list[DirectCall]] = {}
    # Build every record first, so the clocks (and the process CPU time) see only the ledger.
    plans = {r: list(direct_calls(w, r, prefix=prefix)) for r in range(w.rollouts)}

    async def one(r: int) -> None:
        async with sem:
            calls = plans.pop(r)
            for c in calls:
                e = c.entry
                c0 = time.process_time()
                t0 = time.perf_counter()
                await ledger.begin_call(e["rollout_id"], e["model_call_id"], route=ROUTE, model="p")
                t1 = time.perf_counter()
                res = await ledger.put(e, route=ROUTE)
                t2 = time.perf_counter()
                c2 = time.process_time()
                if res.status != "created":
                    raise RuntimeError(f"put answered {res.status} for {e['model_call_id']}")
                samples.append(
                    {
                        "rollout": e["rollout_id"],
                        "turn": c.turn,
                        "kind": c.kind,
                        "prompt_len": len(e["prompt_token_ids"]),
                        "begin_ms": (t1 - t0) * 1e3,
                        "put_ms": (t2 - t1) * 1e3,
                        "call_ms": (t2 - t0) * 1e3,
                        # This process's CPU (all its threads) while the call ran: the call's
                        # own CPU cost when calls run one at a time, meaningless otherwise.
                        "cpu_ms": (c2 - c0) * 1e3,
                        "delta": res.prompt_is_delta,
                        "edge": res.edge_method,
                    }
                )
                # Keep what storage accounting needs; drop the token lists.
                if not keep_calls:
                    c.entry = {k: e[k] for k in ("model_call_id", "response_id")}
            per_rollout[f"{prefix}{r:04d}"] = calls

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(r) for r in range(w.rollouts)))
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    n = len(samples)
    out: dict[str, Any] = {
        "calls": n,
        "rollouts": w.rollouts,
        "concurrency": concurrency,
        "wall_s": wall,
        "calls_per_s": n / wall if wall else None,
        # CPU seconds of this process (event loop + driver threads) per call: what the ledger
        # costs the machine, independent of how busy the machine was.
        "cpu_ms_per_call": cpu * 1e3 / n if n else None,
        "call_ms": summarize([s["call_ms"] for s in samples]),
        "begin_ms": summarize([s["begin_ms"] for s in samples]),
        "put_ms": summarize([s["put_ms"] for s in samples]),
        "delta_fraction": sum(1 for s in samples if s["delta"]) / n if n else None,
        "edges": _count(s["edge"] or "root" for s in samples),
        "by_turn": by_turn(samples),
        "_samples": samples,
        "_calls": per_rollout,
    }
    if concurrency == 1:
        out["by_turn_cpu"] = by_turn(samples, "cpu_ms")
    return out


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def by_turn(samples: list[dict[str, Any]], key: str = "call_ms") -> list[dict[str, Any]]:
    """Median (and p90) of ``key`` per turn number, over main-chain calls."""
    turns: dict[int, list[float]] = {}
    for s in samples:
        if s.get("kind", "turn") == "turn":
            turns.setdefault(s["turn"], []).append(s[key])
    out = []
    for t in sorted(turns):
        vals = sorted(turns[t])
        out.append(
            {
                "turn": t,
                "n": len(vals),
                "median": statistics.median(vals),
                "p90": vals[min(len(vals) - 1, int(0.9 * len(vals)))],
            }
        )
    return out


def raw_sizes(calls: dict[str, list[DirectCall]]) -> list[dict[str, int]]:
    return [distinct_token_stats(cs) for cs in calls.values()]


async def size_snapshot(db: Db) -> dict[str, Any]:
    return {"total": await db.size_bytes(), "objects": await db.table_sizes()}


async def storage(
    db: Db, before: dict[str, Any], raw: list[dict[str, int]], *, prefix: str
) -> dict[str, Any]:
    """Stored bytes per rollout against the raw size of its distinct tokens.

    ``raw``: one ``distinct_token_stats`` per rollout written since ``before`` (a
    :func:`size_snapshot`) was taken; ``prefix`` selects those rollouts' rows."""
    after = await size_snapshot(db)
    n = len(raw)
    raw_bytes = statistics.mean(r["raw_bytes"] for r in raw)
    ln = "length" if db.backend == "sqlite" else "octet_length"
    rows = await db.query(
        f"SELECT c.rollout_id, c.prompt_len, c.generation_len, {ln}(t.prompt_ids), "
        f"{ln}(t.generation_ids), {ln}(t.log_probs) "
        "FROM calls c JOIN call_tokens t ON t.call_id = c.id WHERE c.rollout_id LIKE "
        + ("?" if db.backend == "sqlite" else "$1")
        + " ORDER BY c.rollout_id, c.id",
        prefix + "%",
    )
    # Turn number = position within the rollout (the main chain has one call a turn).
    by_pos: dict[int, list[tuple[int, int]]] = {}
    columns = 0
    last, pos = None, 0
    for rid, plen, glen, pb, gb, lb in rows:
        pos = pos + 1 if rid == last else 1
        last = rid
        stored = int(pb) + int(gb) + int(lb)
        columns += stored
        by_pos.setdefault(pos, []).append((stored, 4 * (plen + glen) + 4 * glen))
    total = after["total"] - before["total"]
    objects = {
        k: v - before["objects"].get(k, 0)
        for k, v in after["objects"].items()
        if v - before["objects"].get(k, 0)
    }
    return {
        "method": (
            "SQLite: database file size after PRAGMA wal_checkpoint(TRUNCATE), growth over the run"
            if db.backend == "sqlite"
            else "Postgres: pg_total_relation_size summed over the ledger tables (heap + TOAST "
            "+ indexes + free-space maps), growth over the run"
        ),
        "rollouts": n,
        "raw_distinct_bytes_per_rollout": raw_bytes,
        "distinct_tokens_per_rollout": statistics.mean(r["distinct_tokens"] for r in raw),
        "stored_bytes_per_rollout": total / n if n else None,
        "ratio": (total / n) / raw_bytes if n and raw_bytes else None,
        "token_column_bytes_per_rollout": columns / n if n else None,
        "token_column_ratio": (columns / n) / raw_bytes if n and raw_bytes else None,
        "objects_bytes_per_rollout": {k: v / n for k, v in sorted(objects.items())} if n else {},
        "output_items_bytes_per_call": await _output_items_bytes(db, prefix),
        "page_use": await db.page_use(),
        "bytes_by_turn": [
            {
                "turn": k,
                "stored_token_bytes": statistics.median(v[0] for v in vals),
                "full_record_bytes": statistics.median(v[1] for v in vals),
            }
            for k, vals in sorted(by_pos.items())
        ],
    }


async def _output_items_bytes(db: Db, prefix: str) -> float | None:
    sql = (
        "SELECT avg(length(output_items)) FROM calls WHERE rollout_id LIKE ?"
        if db.backend == "sqlite"
        else "SELECT avg(octet_length(output_items::text)) FROM calls WHERE rollout_id LIKE $1"
    )
    rows = await db.query(sql, prefix + "%")
    return float(rows[0][0]) if rows and rows[0][0] is not None else None


def rollout_result(rollout_id: str, last_response_id: str | None) -> dict[str, Any]:
    """A NeMo Gym rollout result whose response names the terminal call by its id."""
    return {
        "_ng_rollout_id": rollout_id,
        "reward": 1.0,
        "response": {
            "id": last_response_id,
            "object": "response",
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "done"}],
                }
            ],
        },
    }


async def finalize_all(
    url: str, results: list[dict[str, Any]], *, retire: bool = True
) -> dict[str, Any]:
    """``finalize_rollout_token_capture`` per rollout, one after another; then retire."""
    ledger = TimedLedger(url)
    totals: list[float] = []
    steps: dict[str, list[float]] = {}
    retire_ms: list[float] = []
    outcomes: dict[str, int] = {}
    tokens: list[int] = []
    try:
        for result in results:
            ledger.timings = {}
            t0 = time.perf_counter()
            build = await finalize_rollout_token_capture(result, ledger)
            total = (time.perf_counter() - t0) * 1e3
            assert build is not None
            totals.append(total)
            outcomes[build["outcome"]] = outcomes.get(build["outcome"], 0) + 1
            step = {k: sum(v) for k, v in ledger.timings.items()}
            step["plan_project_other"] = total - sum(step.values())
            for k, v in step.items():
                steps.setdefault(k, []).append(v)
            if build.get("rebuilt_response"):
                tokens.append(build["rebuilt_response"]["usage"]["total_tokens"])
            if retire and build["outcome"] == "delivered":
                t1 = time.perf_counter()
                ok = await ledger.retire(
                    build["rollout_id"], snapshot_id=build["snapshot_id"], version=build["version"]
                )
                retire_ms.append((time.perf_counter() - t1) * 1e3)
                if not ok:
                    raise RuntimeError(f"retire refused for {build['rollout_id']}")
    finally:
        await ledger.close()
    return {
        "rollouts": len(results),
        "outcomes": outcomes,
        "delivered_tokens_per_rollout": statistics.mean(tokens) if tokens else None,
        "finalize_ms": summarize(totals),
        "steps_ms_median": {k: statistics.median(v) for k, v in steps.items()},
        "retire_ms": summarize(retire_ms),
    }
