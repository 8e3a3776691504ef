"""``python -m bench.gymcmp``: the ledger against NeMo Gym 0.7.0's own file store, in one run.

The released ``nemo_gym.token_id_capture.store.TokenCaptureStore`` (the wheel unpacked under
``$ROLLOUT_LEDGER_CACHE/nemo-gym-wheel/extracted``) and the ledger ingest the same calls on the
same disk, alternating, ``--reps`` times; every figure the report shows for the ledger is a ratio
against the Gym store measured in the same repetition, with the spread over repetitions.

Per call, both stores do what Gym's capture path asks of its sink between the upstream answer
and the harness's answer: the intent (``begin_call``), then the record, durable before it
returns.  Both are handed the same records, built and stamped as Gym's ``commit_entry`` stamps
them (``stamp_lineage`` with the resolved parent's cumulative tokens; with ``delta_records`` the
prompt becomes the suffix beyond the parent and ``prompt_is_delta`` is set), the parent's
cumulative tokens from memory (what Gym's request-time resolver hands back).  The stamping is
done before the timed run for both: it is the capture path's work, the same whichever store
follows.  The ledger gets the delta-stamped entries (Gym at its best) unless
``--ledger-records`` says otherwise (``gym_full``; ``plain``: unstamped dicts, as the proxy
sends them).

Phases: ``ingest`` (8 concurrent rollouts x 50 turns, the issue-12 workload), ``bytes``
(stored bytes per rollout at 8x50 and 8x10), ``build`` (freeze + build + projection per rollout,
each side's own ``finalize_rollout_token_capture``), ``long`` (one 200-turn rollout, one call at
a time: CPU per call at turns 191-200 against turns 1-10, and its build).

Writes ``bench/results/gymcmp.json`` (or ``--out``) and, with ``--docs DIR``,
``DIR/performance.md`` and its plots; ``python -m bench.gymreport [FILE]`` renders the page from
a saved run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import machine
from bench.dbs import Db, DbFactory
from bench.direct import ROUTE, rollout_result
from bench.gymreport import RESULTS
from bench.workload import Workload, direct_calls, distinct_token_stats

CACHE = Path(os.environ.get("ROLLOUT_LEDGER_CACHE", Path.home() / ".cache" / "rollout-ledger"))
WHEEL = CACHE / "nemo-gym-wheel" / "extracted"


def _gym() -> Any:
    """Import the released Gym capture package (pure Python) from the unpacked wheel."""
    if str(WHEEL) not in sys.path:
        sys.path.insert(0, str(WHEEL))
    # ``delivery`` needs omegaconf (Gym's config stack); its build step is ``consumer``'s.
    from nemo_gym.token_id_capture import consumer, records, store

    return records, store, consumer


# --------------------------------------------------------------------------- one side each


def _plans(w: Workload, prefix: str) -> list[list[Any]]:
    return [list(direct_calls(w, r, prefix=prefix)) for r in range(w.rollouts)]


async def _drive(
    plans: list[list[Any]], call: Callable[[dict[str, Any], dict[str, Any]], Any]
) -> dict[str, Any]:
    """Run every rollout's calls in order, all rollouts at once; per-call CPU when sequential.

    ``call`` returns the CPU ms its store spent (``begin_call`` + ``put``)."""
    cpu_by_turn: dict[int, list[float]] = {}
    sink_by_turn: dict[int, list[float]] = {}

    async def one(calls: list[Any]) -> None:
        state: dict[str, Any] = {}
        for c in calls:
            c0 = time.process_time()
            sink_ms = await call(c.entry, state)
            cpu_by_turn.setdefault(c.turn, []).append((time.process_time() - c0) * 1e3)
            sink_by_turn.setdefault(c.turn, []).append(sink_ms)

    n = sum(len(p) for p in plans)
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(p) for p in plans))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "calls": n,
        "wall_s": wall,
        "calls_per_s": n / wall,
        "cpu_ms_per_call": cpu * 1e3 / n,
        "cpu_ms_by_turn": {t: statistics.median(v) for t, v in sorted(cpu_by_turn.items())},
        "sink_cpu_ms_by_turn": {t: statistics.median(v) for t, v in sorted(sink_by_turn.items())},
    }


class GymStamper:
    """Gym 0.7.0's ``commit_entry`` between the upstream answer and ``sink.put``: the
    ``TokenEntry`` that ``capture_tokens`` builds, stamped with ``stamp_lineage`` and the
    resolved parent (the parent's cumulative tokens from memory, as the request-time resolver
    hands them back); with ``delta`` the prompt becomes the suffix beyond the parent."""

    def __init__(self, *, delta: bool) -> None:
        self.records, _store, _consumer = _gym()
        self.delta = delta
        self.RESOLVED = self.records.ParentResolutionStatus.RESOLVED
        self.ROOT = self.records.ParentResolutionStatus.ROOT

    def entry(self, e: dict[str, Any], state: dict[str, Any]) -> Any:
        entry = self.records.TokenEntry(**e)
        parent = state.get("parent")
        if parent is None:
            self.records.stamp_lineage(entry, None, parent_resolution=self.ROOT)
        else:
            pid, parent_cum = parent
            cumulative = None
            prompt = list(entry.prompt_token_ids)
            if (
                self.delta
                and len(prompt) >= len(parent_cum)
                and prompt[: len(parent_cum)] == parent_cum
            ):
                cumulative = prompt + list(entry.generation_token_ids)
                entry.prompt_token_ids = prompt[len(parent_cum) :]
                entry.prompt_is_delta = True
            self.records.stamp_lineage(
                entry, pid, parent_resolution=self.RESOLVED, cumulative=cumulative
            )
        state["parent"] = (
            e["model_call_id"],
            list(e["prompt_token_ids"]) + list(e["generation_token_ids"]),
        )
        return entry


def _prestamp(stamper: GymStamper, plans: list[list[Any]]) -> dict[str, Any]:
    """Every call's entry as ``commit_entry`` hands it to the store, stamped ahead of the timed
    run: the stamping is the capture path's work, the same whichever store follows, so neither
    side's calls/s or CPU counts it."""
    out: dict[str, Any] = {}
    for calls in plans:
        state: dict[str, Any] = {}
        for c in calls:
            out[c.entry["model_call_id"]] = stamper.entry(c.entry, state)
    return out


class GymSide:
    """NeMo Gym 0.7.0's file store, records stamped as its capture path stamps them."""

    def __init__(self, root: Path, *, delta: bool) -> None:
        _records, store, self.consumer = _gym()
        self.root = root
        self.store = store.TokenCaptureStore(root)
        self.stamper = GymStamper(delta=delta)
        self.stamped: dict[str, Any] = {}

    def prestamp(self, plans: list[list[Any]]) -> None:
        self.stamped = _prestamp(self.stamper, plans)

    async def call(self, e: dict[str, Any], state: dict[str, Any]) -> float:
        rid, cid = e["rollout_id"], e["model_call_id"]
        c0 = time.process_time()
        await self.store.begin_call(rid, cid)
        await self.store.put(self.stamped.pop(cid))
        return (time.process_time() - c0) * 1e3

    def bytes_on_disk(self, rollout_ids: list[str]) -> int:
        total = 0
        for rid in rollout_ids:
            for p in self.root.glob(f"{rid}.tokens*"):
                total += p.stat().st_size
        return total

    async def finalize(self, result: dict[str, Any]) -> dict[str, Any] | None:
        # The build inside Gym's ``finalize_rollout_token_capture``: freeze, build, project.
        response = result["response"]
        out: dict[str, Any] | None = await self.consumer.trajectories_from_source(
            result["_ng_rollout_id"], self.store, model="", verified_response=response
        )
        return out

    async def close(self) -> None:
        pass


class LedgerSide:
    """The ledger as Gym's capture path drives its sink (``begin_call``, then ``put`` of the
    entry ``commit_entry`` stamped: ``records`` ``gym_delta`` or ``gym_full``), or as the
    proxy drives it (``plain``: the record as a dict, unstamped)."""

    def __init__(self, db: Db, records: str = "gym_delta") -> None:
        from ledger.store import Ledger

        self.db = db
        self.ledger = Ledger(db.url)
        self.records = records
        self.stamper = GymStamper(delta=records == "gym_delta") if records != "plain" else None
        self.stamped: dict[str, Any] = {}

    def prestamp(self, plans: list[list[Any]]) -> None:
        if self.stamper is not None:
            self.stamped = _prestamp(self.stamper, plans)

    async def call(self, e: dict[str, Any], state: dict[str, Any]) -> float:
        c0 = time.process_time()
        await self.ledger.begin_call(e["rollout_id"], e["model_call_id"], route=ROUTE, model="p")
        entry: Any = self.stamped.pop(e["model_call_id"], e)
        res = await self.ledger.put(entry, route=ROUTE)
        if res.status != "created":
            raise RuntimeError(f"put answered {res.status} for {e['model_call_id']}")
        return (time.process_time() - c0) * 1e3

    async def warm(self) -> None:
        """Open the ledger's connections (and its once-per-process schema check) before a timed
        run or build: a serving ledger holds both already, and Gym's file store has none."""
        import sqlalchemy as sa

        await self.ledger.warm_up(connections=16)
        async with self.ledger.engine.connect() as conn:
            await conn.execute(sa.text("SELECT 1"))

    async def finalize(self, result: dict[str, Any]) -> dict[str, Any] | None:
        from ledger.delivery import finalize_rollout_token_capture

        out: dict[str, Any] | None = await finalize_rollout_token_capture(result, self.ledger)
        return out

    async def close(self) -> None:
        await self.ledger.close()


# --------------------------------------------------------------------------- phases


async def _finalize_all(side: Any, plans: list[list[Any]]) -> dict[str, Any]:
    ms: list[float] = []
    cpu: list[float] = []
    faults: list[int] = []
    outcomes: dict[str, int] = {}
    for calls in plans:
        last = [c for c in calls if c.kind == "turn"][-1].entry
        result = rollout_result(last["rollout_id"], last["response_id"])
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0 = time.perf_counter(), time.process_time()
        built = await side.finalize(result)
        ms.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        outcome = _outcome(built)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        del built, result  # as a consumer drops a delivered rollout: its memory is reused
    return {
        "ms_p50": statistics.median(ms),
        "ms_max": max(ms),
        # CPU of the whole process (every thread) during the build: steadier than wall time
        # on a shared machine.
        "cpu_ms_p50": statistics.median(cpu),
        # Minor page faults of the process during the build: fresh memory taken from the
        # system (the output's lists, the first time a process makes that much).
        "page_faults_p50": statistics.median(faults),
        "outcomes": outcomes,
    }


def _outcome(built: dict[str, Any] | None) -> str:
    if built is None:
        return "none"
    if "outcome" in built:
        return str(built["outcome"])
    if built.get("mask_sample"):
        return "masked"
    return "delivered"


async def _run_side(
    kind: str,
    w: Workload,
    tmp: Path,
    dbs: DbFactory,
    label: str,
    *,
    build: bool,
    build_again: bool = False,
    records: str = "gym_delta",
    batches: int = 1,
) -> dict[str, Any]:
    """One side's run; with ``batches`` > 1, that many batches of ``w`` (fresh seeds) one after
    another, stored bytes per rollout over all of them (timing and build: the first batch)."""
    prefix = f"{label}-"
    plans = _plans(w, prefix)
    more = [_plans(replace(w, seed=w.seed + 1000 * k), f"{label}b{k}-") for k in range(1, batches)]
    every = [p for batch in [plans, *more] for p in batch]
    raw = statistics.mean(distinct_token_stats(p)["raw_bytes"] for p in every)
    side: Any
    db: Db | None = None
    if kind.startswith("gym"):
        root = tmp / f"gym-{label}"
        side = GymSide(root, delta=kind == "gym_delta")
    else:
        db = await dbs.create(kind, label.replace("-", "_"))
        # Postgres: autovacuum stays off the ledger's tables for the run; its first visit to a
        # table adds the free-space and visibility maps (about 32 KiB per relation, none of it
        # per rollout) at a moment of its own choosing, which swung 8x50 bytes by +-0.3x raw.
        await db.pause_autovacuum()
        side = LedgerSide(db, records)
    try:
        # A warm-up batch (as many concurrent rollouts, up to 10 turns), counted nowhere: stored
        # bytes are the growth of a database already in use, not the one-off pages a brand-new
        # one pays as its first rows arrive (Postgres: each touched index's first leaf page,
        # each heap's free space map, and one partly filled page per table per connection
        # inserting at once; about 0.5-0.7x raw at 8x10 cold, none of it per rollout).  Every
        # side runs it, so timing stays symmetric.
        warm = _plans(replace(w, turns=min(w.turns, 10)), f"{prefix}warm-")
        side.prestamp(warm)
        await _drive(warm, side.call)
        if db is not None:
            await side.ledger.close()
            side = LedgerSide(db, records)
            before = await db.size_bytes()
            # Its connections open, as a serving ledger's are (Gym's file store opens none).
            await side.warm()
        side.prestamp(every)
        # The workload's own token lists (about 11M ints at 200 turns) are the bench's, not the
        # store's: keep them out of the cyclic collector's full scans, on every side alike, as
        # `rollout-ledger serve` freezes its startup heap (a trainer holds tensors, not lists).
        gc.collect()
        gc.freeze()
        out = await _drive(plans, side.call)
        for batch in more:
            await _drive(batch, side.call)
        rids = sorted({c.entry["rollout_id"] for p in every for c in p})
        if db is None:
            stored = side.bytes_on_disk(rids)
        else:
            await side.ledger.close()
            side = LedgerSide(db, records)
            stored = await db.size_bytes() - before
            out["unused_pages_counted"] = db.unused_pages_counted
        out["stored_bytes_per_rollout"] = stored / len(rids)
        out["raw_bytes_per_rollout"] = raw
        out["bytes_ratio"] = stored / len(rids) / raw
        out["bytes_rollouts"] = len(rids)
        if build:
            if db is not None:
                await side.warm()
            out["build"] = await _finalize_all(side, plans)
        if build_again:  # the same frozen snapshots built again: a warm process and connection
            out["build_again"] = await _finalize_all(side, plans)
    finally:
        gc.unfreeze()
        await side.close()
        if db is not None:
            await dbs.drop(db)
        elif kind.startswith("gym"):
            shutil.rmtree(tmp / f"gym-{label}", ignore_errors=True)
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


async def run_builds(args: argparse.Namespace) -> dict[str, Any]:
    """Only the build phases (``--build-only``): per repetition, each side ingests the 8x50
    workload (not timed) and builds every rollout; then the long rollout's build.  Ratios are
    against Gym's faster store in the same repetition."""
    w = Workload(rollouts=args.rollouts, turns=args.turns)
    sides = ["gym_full", "gym_delta", *args.backends]
    tmp = Path(tempfile.mkdtemp(prefix="rl_gymcmp_", dir=args.workdir))
    dbs = DbFactory(tmp)
    reps: list[dict[str, Any]] = []
    long: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            row: dict[str, Any] = {}
            order = sides[rep % len(sides) :] + sides[: rep % len(sides)]
            for kind in order:
                res = await _run_side(kind, w, tmp, dbs, f"{kind[:3]}b{rep}", build=True)
                row[kind] = res["build"]
            reps.append(row)
            if args.long_turns:
                lw = replace(w, rollouts=1, turns=args.long_turns)
                lrow: dict[str, Any] = {}
                for kind in ["gym_delta", *args.backends]:  # as the long phase: Gym's best
                    res = await _run_side(
                        kind, lw, tmp, dbs, f"{kind[:3]}L{rep}", build=True, build_again=True
                    )
                    lrow[kind] = res["build"]
                    lrow[f"{kind}_again"] = res["build_again"]
                long.append(lrow)
            line = [f"rep {rep}:"]
            for b in args.backends:
                gym = min(row[g]["ms_p50"] for g in ("gym_full", "gym_delta"))
                line.append(
                    f"{b} 8x{w.turns} build p50 {row[b]['ms_p50']:.1f} ms "
                    f"(cpu {row[b]['cpu_ms_p50']:.1f}) = {row[b]['ms_p50'] / gym:.2f}x Gym's "
                    f"{gym:.1f} ms"
                )
                if long:
                    lg = long[-1]["gym_delta"]["ms_p50"]
                    again = long[-1][f"{b}_again"]
                    line.append(
                        f"{b} {args.long_turns}-turn build {long[-1][b]['ms_p50']:.1f} ms "
                        f"(cpu {long[-1][b]['cpu_ms_p50']:.1f}; Gym {lg:.1f} ms); built again "
                        f"{again['ms_p50']:.1f} ms (cpu {again['cpu_ms_p50']:.1f}; Gym "
                        f"{long[-1]['gym_delta_again']['ms_p50']:.1f} ms)"
                    )
            print("\n  ".join(line), file=sys.stderr, flush=True)
    finally:
        await dbs.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "workload": w.describe(),
        "build_reps": reps,
        "long_build_reps": long,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    w = Workload(rollouts=args.rollouts, turns=args.turns)
    sides = ["gym_full", "gym_delta", *args.backends]
    tmp = Path(tempfile.mkdtemp(prefix="rl_gymcmp_", dir=args.workdir))
    dbs = DbFactory(tmp)
    fsync0 = machine.fsync_probe(tmp, n=50)
    machine_info = await machine.describe(tmp, None)
    reps: list[dict[str, Any]] = []
    try:
        for rep in range(args.reps):
            row: dict[str, Any] = {}
            # Rotate the order so no side always runs first (or last) in a repetition.
            order = sides[rep % len(sides) :] + sides[: rep % len(sides)]
            for kind in order:
                machine.load_snapshot()
                res = await _run_side(
                    kind,
                    w,
                    tmp,
                    dbs,
                    f"{kind[:3]}{rep}",
                    build=rep == 0 or args.build_every,
                    records=args.ledger_records,
                )
                res["load"] = machine.load_snapshot()
                row[kind] = res
                print(
                    f"rep {rep} {kind}: {res['calls_per_s']:.0f} calls/s, "
                    f"{res['cpu_ms_per_call']:.2f} CPU ms/call, bytes {res['bytes_ratio']:.2f}x"
                    + (f", build p50 {res['build']['ms_p50']:.1f} ms" if "build" in res else ""),
                    file=sys.stderr,
                    flush=True,
                )
            reps.append(row)
        small = replace(w, turns=10)
        bytes_8x10 = {}
        # As many calls as the 8x50 figure: 80 calls fill a few pages per relation, so Postgres'
        # page granularity (partly filled pages, extension ahead of use) swung the ratio by
        # +-0.3x from run to run; over 400 calls it is a few percent.
        for kind in sides:
            res = await _run_side(
                kind,
                small,
                tmp,
                dbs,
                f"{kind[:3]}s",
                build=False,
                records=args.ledger_records,
                batches=max(1, w.turns // 10),
            )
            bytes_8x10[kind] = {
                "stored_bytes_per_rollout": res["stored_bytes_per_rollout"],
                "bytes_ratio": res["bytes_ratio"],
            }
        long: dict[str, Any] = {}
        if args.long_turns:
            lw = replace(w, rollouts=1, turns=args.long_turns)
            for kind in ["gym_delta", *args.backends]:
                res = await _run_side(
                    kind,
                    lw,
                    tmp,
                    dbs,
                    f"{kind[:3]}l",
                    build=True,
                    build_again=True,
                    records=args.ledger_records,
                )
                # The store's own CPU per call (the bench's own bookkeeping excluded).
                by_turn = res["sink_cpu_ms_by_turn"]
                first = [by_turn[t] for t in range(1, 11)]
                last = [by_turn[t] for t in range(lw.turns - 9, lw.turns + 1)]
                long[kind] = {
                    "turns": lw.turns,
                    "cpu_ms_first10": statistics.median(first),
                    "cpu_ms_last10": statistics.median(last),
                    "ratio": statistics.median(last) / statistics.median(first),
                    "build_ms": res["build"]["ms_p50"],
                    # The process's CPU over the build: a build whose wall time is far above
                    # it waited (on the machine, the disk), it did not work longer.
                    "build_cpu_ms": res["build"]["cpu_ms_p50"],
                    # The first build takes the output's memory fresh from the system; built
                    # again (same snapshot), the process reuses what the first one freed.
                    "build_page_faults": res["build"]["page_faults_p50"],
                    "build_again_ms": res["build_again"]["ms_p50"],
                    "build_again_cpu_ms": res["build_again"]["cpu_ms_p50"],
                    "build_again_page_faults": res["build_again"]["page_faults_p50"],
                    "cpu_ms_by_turn": by_turn,
                    "call_cpu_ms_by_turn": res["cpu_ms_by_turn"],
                }
                print(f"long {kind}: {long[kind]['ratio']:.2f}x", file=sys.stderr, flush=True)
        proxy_out = await _proxy_overhead(args, tmp, dbs) if args.proxy_samples else {}
    finally:
        await dbs.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "ledger_records": args.ledger_records,
        "proxy": proxy_out,
        "generated": datetime.now(UTC).isoformat(timespec="seconds"),
        "workload": w.describe(),
        "reps": reps,
        "ratios": _ratios(reps, args.backends),
        "bytes_8x10": bytes_8x10,
        "long": long,
        "fsync_start": fsync0,
        "machine": machine_info,
        # The CPU probe again: the machine is shared, and its speed at the end says whether
        # the run's later phases (the long rollout, the proxy) ran on the machine it began on.
        "cpu_probe_end": machine.cpu_probe(),
    }


async def _proxy_overhead(args: argparse.Namespace, tmp: Path, dbs: DbFactory) -> dict[str, Any]:
    """p50 overhead at 16k-token prompts: ``rollout-ledger serve`` (SQLite) and the bare
    pass-through proxy, each against the same simulated upstream, in this run."""
    from bench import proxy

    async def db_url(label: str) -> str:
        return (await dbs.create("sqlite", f"proxy{label}")).url

    return await proxy.compare_overhead(tmp, db_url, samples=args.proxy_samples)


def _ratios(reps: list[dict[str, Any]], backends: list[str]) -> dict[str, Any]:
    """Per backend: calls/s against Gym at its best in the same repetition, with spread."""
    out: dict[str, Any] = {}
    for b in backends:
        best = [max(r["gym_full"]["calls_per_s"], r["gym_delta"]["calls_per_s"]) for r in reps]
        mine = [r[b]["calls_per_s"] for r in reps]
        out[b] = {
            "calls_per_s": _spread(mine),
            "gym_best_calls_per_s": _spread(best),
            "ratio_vs_gym_best": _spread([m / g for m, g in zip(mine, best, strict=True)]),
            "cpu_ms_per_call": _spread([r[b]["cpu_ms_per_call"] for r in reps]),
            # The median over repetitions (Postgres relation sizes jump by whole extensions of
            # a table when several connections insert at once: a single run moves +-0.3x).
            "bytes_ratio": statistics.median(r[b]["bytes_ratio"] for r in reps),
            "bytes_ratio_spread": _spread([r[b]["bytes_ratio"] for r in reps]),
        }
        if "build" in reps[0][b]:
            gb = min(reps[0][g]["build"]["ms_p50"] for g in ("gym_full", "gym_delta"))
            out[b]["build_vs_gym_best"] = reps[0][b]["build"]["ms_p50"] / gb
    for g in ("gym_full", "gym_delta"):
        out[g] = {
            "calls_per_s": _spread([r[g]["calls_per_s"] for r in reps]),
            "cpu_ms_per_call": _spread([r[g]["cpu_ms_per_call"] for r in reps]),
            "bytes_ratio": reps[0][g]["bytes_ratio"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gymcmp", description=__doc__)
    # Five: a repetition's ingest is 400 calls (under half a second on the ledger's side), and on
    # a shared 2-vCPU machine one slow second moves a repetition's ratio by a third; the median
    # of three moved with it from run to run.
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--long-turns", type=int, default=200, help="0 skips the long rollout")
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument(
        "--proxy-samples",
        type=int,
        default=30,
        help="proxy overhead pairs (0 skips the phase; at 10 a root p50 swung 2 ms run to run)",
    )
    ap.add_argument(
        "--ledger-records",
        choices=["gym_delta", "gym_full", "plain"],
        default="gym_delta",
        help="what the ledger is fed: Gym-stamped entries with delta records on (Gym at its "
        "best) or off, or unstamped dicts as the proxy sends them",
    )
    ap.add_argument("--build-every", action="store_true", help="build in every repetition")
    ap.add_argument(
        "--build-only",
        action="store_true",
        help="only the build phases (8x50 and the long rollout), each repetition; prints "
        "ratios against Gym and writes --out (default bench/results/gymcmp-build.json)",
    )
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "gymcmp.json")
    ap.add_argument(
        "--docs",
        type=Path,
        default=None,
        help="also write DOCS/performance.md and its plots (docs/ for the published page)",
    )
    args = ap.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    if args.build_only:
        if args.out == RESULTS / "gymcmp.json":
            args.out = RESULTS / "gymcmp-build.json"
        built = asyncio.run(run_builds(args))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(built, indent=1, default=str) + "\n")
        return 0
    out = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    if args.docs is not None:
        from bench import gymreport

        gymreport.write(out, args.docs)
        print(f"wrote {args.docs / 'performance.md'}", file=sys.stderr)
    r = out["ratios"]
    for b in args.backends:
        s = r[b]["ratio_vs_gym_best"]
        print(
            f"{b}: {s['median']:.2f}x Gym's best calls/s (range {s['min']:.2f}-{s['max']:.2f}, "
            f"n={s['n']}); bytes {r[b]['bytes_ratio']:.2f}x raw; "
            f"build {r[b].get('build_vs_gym_best', float('nan')):.2f}x Gym's",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
