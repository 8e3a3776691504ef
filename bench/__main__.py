"""``python -m bench run [--quick]``: measure, write the results JSON, regenerate the report.

Full run (the default): the issue #5 workload (8 concurrent rollouts x 50 turns, 2,000-token
system prompt, 200-token tool outputs, 300-token generations) on SQLite and Postgres, directly
through the Ledger API and through ``rollout-ledger serve`` in front of the simulated engine;
writes ``bench/results/full.json``, ``docs/performance-detail.md`` and ``docs/perf-turn-*.png``.

``--quick``: a smoke run of every phase on a tiny workload; writes under
``bench/results/quick/`` and leaves the published report alone.

``python -m bench report [--results FILE]`` regenerates the report from a results file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import direct, machine, micro, proxy, replay, report, transport
from bench.dbs import DbFactory
from bench.variants import make_ledger
from bench.workload import Workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"


@dataclass
class Config:
    mode: str
    workload: Workload
    iso_rollouts: int
    overhead_samples: int
    overhead_prompt_tokens: int = 16_000
    sweep: list[int] = field(default_factory=list)
    extras: Workload | None = None
    backends: list[str] = field(default_factory=lambda: ["sqlite", "postgres"])
    proxy: bool = True
    variants: bool = True


def config(quick: bool) -> Config:
    if quick:
        w = Workload(rollouts=2, turns=6)
        return Config(
            "quick",
            w,
            iso_rollouts=1,
            overhead_samples=3,
            sweep=[4],
            extras=replace(w, turns=6, retry_every=3, side_call_every=2),
        )
    w = Workload()
    return Config(
        "full",
        w,
        iso_rollouts=5,
        overhead_samples=30,
        sweep=[32],
        extras=replace(w, retry_every=10, side_call_every=10),
    )


class Recorder:
    """Phase log: wall time and machine load around each phase (printed as it goes)."""

    def __init__(self, workdir: Path) -> None:
        self.phases: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self.workdir = workdir

    @contextlib.asynccontextmanager
    async def phase(self, name: str) -> AsyncIterator[None]:
        machine.load_snapshot()  # resets the CPU-busy window
        t0 = time.perf_counter()
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {name} ...", file=sys.stderr, flush=True)
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            snap = machine.load_snapshot()
            fsync = machine.fsync_probe(self.workdir, n=25)["p50_ms"]
            self.phases.append({"phase": name, "seconds": seconds, **snap, "fsync_p50_ms": fsync})
            print(
                f"[{time.perf_counter() - self.t0:7.1f}s] {name} done "
                f"({seconds:.1f}s, load {snap['loadavg_1m']}, "
                f"cpu {snap['cpu_busy_pct']}%, fsync {fsync:.2f} ms)",
                file=sys.stderr,
                flush=True,
            )


def _public(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def _ingest_summary(res: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "calls",
        "rollouts",
        "concurrency",
        "wall_s",
        "calls_per_s",
        "cpu_ms_per_call",
        "call_ms",
        "begin_ms",
        "put_ms",
        "delta_fraction",
        "edges",
    )
    return {k: res[k] for k in keep if k in res}


async def _warm(ledger: Any) -> None:
    """Compile SQL and fill pools on a throwaway rollout before anything is timed."""
    await direct.ingest(ledger, Workload(rollouts=1, turns=3), prefix="warm")


# --------------------------------------------------------------------------- direct


@contextlib.asynccontextmanager
async def _database(f: DbFactory, backend: str, name: str) -> AsyncIterator[Any]:
    """A fresh database for one phase, dropped after it."""
    db = await f.create(backend, name)
    try:
        yield db
    finally:
        await f.drop(db)


@contextlib.asynccontextmanager
async def _warm_ledger(kind: str, url: str) -> AsyncIterator[Any]:
    """A ``kind`` ledger over ``url``, warmed up with its batch count reset; closed after."""
    led = make_ledger(kind, url)
    try:
        await _warm(led)
        _batches(led)
        yield led
    finally:
        await led.close()


async def run_direct(backend: str, cfg: Config, f: DbFactory, rec: Recorder) -> dict[str, Any]:
    out: dict[str, Any] = {}
    w = cfg.workload
    async with _database(f, backend, "direct") as db:
        async with _warm_ledger("stock", db.url) as led:
            before = await direct.size_snapshot(db)
            async with rec.phase(f"{backend}: direct ingest {w.rollouts}x{w.turns}"):
                res = await direct.ingest(led, w, prefix="r")
            out["ingest"] = {**_ingest_summary(res), "by_turn": res["by_turn"], **_batches(led)}
            async with rec.phase(f"{backend}: storage"):
                out["storage"] = await direct.storage(
                    db, before, direct.raw_sizes(res["_calls"]), prefix="r"
                )
                if backend == "postgres":
                    await db.vacuum()
                    after_vacuum = await direct.storage(
                        db, before, direct.raw_sizes(res["_calls"]), prefix="r"
                    )
                    out["storage"]["after_vacuum"] = {
                        k: after_vacuum[k]
                        for k in ("stored_bytes_per_rollout", "ratio", "objects_bytes_per_rollout")
                    }
            iso_w = replace(w, rollouts=cfg.iso_rollouts)
            async with rec.phase(f"{backend}: per-turn cost, {cfg.iso_rollouts} rollouts alone"):
                iso = await direct.ingest(led, iso_w, prefix="i", concurrency=1)
            out["isolated"] = {**_ingest_summary(iso), "by_turn": iso["by_turn"]}
            out["isolated"]["by_turn_begin"] = direct.by_turn(iso["_samples"], "begin_ms")
            out["isolated"]["by_turn_put"] = direct.by_turn(iso["_samples"], "put_ms")
            out["isolated"]["by_turn_cpu"] = iso.get("by_turn_cpu")
        results = [
            direct.rollout_result(rid, calls[-1].entry["response_id"])
            for rid, calls in res["_calls"].items()
        ]
        async with rec.phase(f"{backend}: freeze + build + projection"):
            out["finalize"] = await direct.finalize_all(db.url, results)
        if cfg.extras is not None:
            out["extras"] = await run_extras(backend, cfg.extras, f, rec)
    return out


async def run_extras(backend: str, w: Workload, f: DbFactory, rec: Recorder) -> dict[str, Any]:
    """The same workload with abandoned retries and side calls: lineage and build still hold."""
    async with _database(f, backend, "extras") as db:
        async with (
            _warm_ledger("stock", db.url) as led,
            rec.phase(
                f"{backend}: retries every {w.retry_every}, side calls every {w.side_call_every}"
            ),
        ):
            res = await direct.ingest(led, w, prefix="x")
        results = []
        for rid, calls in res["_calls"].items():
            last = [c for c in calls if c.kind == "turn"][-1]
            results.append(direct.rollout_result(rid, last.entry["response_id"]))
        fin = await direct.finalize_all(db.url, results)
        return {"workload": w.describe(), "ingest": _ingest_summary(res), "finalize": fin}


def _batches(ledger: Any) -> dict[str, Any]:
    """Mean group-commit batch size since the last call (and reset the count)."""
    sizes = list(getattr(ledger, "batch_sizes", None) or [])
    if not sizes:
        return {}
    ledger.batch_sizes.clear()
    return {"writes_per_commit": sum(sizes) / len(sizes), "commits": len(sizes)}


async def run_variants(backend: str, cfg: Config, f: DbFactory, rec: Recorder) -> dict[str, Any]:
    """Prototypes and diagnostics on the same workload: 8 concurrent rollouts, and one rollout
    alone (SQLite's lazy intent: alone only); the stock ledger at higher concurrency."""
    w = cfg.workload
    if backend == "sqlite":
        kinds = {"nogroup": True, "flushintent": False, "nosync": True}
    else:
        kinds = {"flushintent": True}
    out: dict[str, Any] = {}
    for kind, concurrent in kinds.items():
        async with _database(f, backend, kind) as db, _warm_ledger(kind, db.url) as led:
            entry: dict[str, Any] = {}
            if concurrent:
                async with rec.phase(f"{backend}: variant {kind} {w.rollouts}x{w.turns}"):
                    res = await direct.ingest(led, w, prefix="v")
                entry.update(_ingest_summary(res), by_turn=res["by_turn"], **_batches(led))
            async with rec.phase(f"{backend}: variant {kind}, one rollout alone"):
                alone = await direct.ingest(led, replace(w, rollouts=1), prefix="a", concurrency=1)
            entry["alone_call_ms"] = alone["call_ms"]
            entry["alone_begin_ms"] = alone["begin_ms"]
        out[kind] = entry
    for n in cfg.sweep if backend == "sqlite" else []:
        async with _database(f, backend, "sweep") as db, _warm_ledger("stock", db.url) as led:
            async with rec.phase(f"{backend}: stock {n}x{w.turns}"):
                big = await direct.ingest(led, replace(w, rollouts=n), prefix=f"s{n}-")
            out.setdefault("stock_sweep", []).append({**_ingest_summary(big), **_batches(led)})
    return out


# --------------------------------------------------------------------------- proxy


async def _timings(url: str, reset: bool = False) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(url + "/_bench/timings", params={"reset": "1"} if reset else None)
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data


async def _overhead(serve_url: str, sim_url: str, cfg: Config) -> dict[str, Any]:
    """The proxy's added latency per call at the configured prompt size."""
    return await proxy.overhead(
        serve_url,
        sim_url,
        samples=cfg.overhead_samples,
        prompt_tokens=cfg.overhead_prompt_tokens,
        tool_tokens=cfg.workload.tool_tokens,
        prefix="o",
    )


async def run_proxy(
    backend: str, cfg: Config, f: DbFactory, rec: Recorder, sim: proxy.ServerProcess, logs: Path
) -> dict[str, Any]:
    """``rollout-ledger serve``: load, storage, overhead at 16k, RSS, then build every rollout."""
    out: dict[str, Any] = {}
    w = cfg.workload
    db = await f.create(backend, "proxy")
    try:
        port = proxy.free_port()
        srv = proxy.ServerProcess(
            proxy.serve_command(db.url, sim.url, port),
            port,
            "/healthz",
            logs / f"serve-{backend}.log",
        )
        with proxy.running(srv):
            assert srv.proc is not None
            with proxy.RssSampler(srv.proc.pid) as rss:
                rss.mark("idle")
                await proxy.load(srv.url, Workload(rollouts=1, turns=3), prefix="w")
                before = await direct.size_snapshot(db)
                rss.mark("load")
                async with rec.phase(f"{backend}: proxy load {w.rollouts}x{w.turns}"):
                    assert sim.proc is not None
                    ld = await proxy.load(
                        srv.url,
                        w,
                        prefix="p",
                        cpu_pids={"serve": srv.proc.pid, "upstream": sim.proc.pid},
                    )
                out["load"] = _public(ld)
                raws = [fin["raw"] for fin in ld["_finals"].values()]
                out["storage"] = await direct.storage(db, before, raws, prefix="p")
                rss.mark("overhead")
                async with rec.phase(f"{backend}: proxy overhead at {cfg.overhead_prompt_tokens}"):
                    out["overhead"] = await _overhead(srv.url, sim.url, cfg)
            out["rss"] = rss.report()
        results = [
            direct.rollout_result(rid, fin["response_id"]) for rid, fin in ld["_finals"].items()
        ]
        async with rec.phase(f"{backend}: build the proxy-captured rollouts"):
            out["finalize"] = await direct.finalize_all(db.url, results)
    finally:
        await f.drop(db)
    return out


async def run_proxy_variant(
    backend: str,
    kind: str,
    cfg: Config,
    f: DbFactory,
    rec: Recorder,
    sim: proxy.ServerProcess,
    logs: Path,
    *,
    with_load: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    w = cfg.workload
    db = await f.create(backend, f"pv{kind}")
    try:
        port = proxy.free_port()
        argv = [
            sys.executable,
            "-m",
            "bench.serve_variant",
            "--ledger",
            kind,
            "--db",
            db.url,
            "--upstream",
            sim.url,
            "--port",
            str(port),
        ]
        srv = proxy.ServerProcess(argv, port, "/healthz", logs / f"variant-{backend}-{kind}.log")
        with proxy.running(srv):
            await proxy.load(srv.url, Workload(rollouts=1, turns=3), prefix="w")
            if with_load:
                await _timings(srv.url, reset=True)
                async with rec.phase(f"{backend}: proxy variant {kind} load"):
                    assert srv.proc is not None and sim.proc is not None
                    ld = await proxy.load(
                        srv.url,
                        w,
                        prefix="p",
                        cpu_pids={"serve": srv.proc.pid, "upstream": sim.proc.pid},
                    )
                out["load"] = {k: v for k, v in _public(ld).items() if k != "by_turn"}
                sizes = (await _timings(srv.url))["batch_sizes"]
                if sizes:
                    out["load"]["writes_per_commit"] = sum(sizes) / len(sizes)
            await _timings(srv.url, reset=True)
            async with rec.phase(f"{backend}: proxy variant {kind} overhead"):
                ov = await _overhead(srv.url, sim.url, cfg)
            out["overhead"] = ov
            t = (await _timings(srv.url))["timings"]
            if t.get("begin_call") and t.get("put"):
                out["breakdown"] = report.overhead_breakdown(ov, t, warmup_calls=6)
    finally:
        await f.drop(db)
    return out


# --------------------------------------------------------------------------- main


async def run(cfg: Config, out_json: Path, docs_dir: Path) -> dict[str, Any]:
    f = DbFactory()
    rec = Recorder(f.tmp)
    logs = f.tmp  # server logs live (and die) with the run's temp dir
    results: dict[str, Any] = {"backends": {}}
    started = datetime.now(UTC)
    try:
        pg_problem = await f.pg_available() if "postgres" in cfg.backends else "not requested"
        pg_version = None
        if pg_problem is None:
            import asyncpg

            from bench.dbs import pg_admin_url

            conn = await asyncpg.connect(pg_admin_url())
            try:
                pg_version = await conn.fetchval("SHOW server_version")
                pg_settings = {
                    k: await conn.fetchval(f"SHOW {k}")
                    for k in (
                        "synchronous_commit",
                        "fsync",
                        "wal_sync_method",
                        "commit_delay",
                        "shared_buffers",
                    )
                }
            finally:
                await conn.close()
        else:
            pg_settings = {}
        backends = [b for b in cfg.backends if b == "sqlite" or pg_problem is None]
        results["meta"] = {
            "mode": cfg.mode,
            "started": started.isoformat(timespec="seconds"),
            "command": " ".join(["python -m bench", *sys.argv[1:]]),
            "workload": cfg.workload.describe(),
            "iso_rollouts": cfg.iso_rollouts,
            "overhead_samples": cfg.overhead_samples,
            "overhead_prompt_tokens": cfg.overhead_prompt_tokens,
            "machine": await machine.describe(f.tmp, pg_version),
            "postgres_settings": pg_settings,
            "postgres_skipped": pg_problem if "postgres" not in backends else None,
        }
        async with rec.phase("proxy CPU per step (micro)"):
            results["micro"] = {
                str(n): await asyncio.to_thread(micro.proxy_steps, n, cfg.workload.gen_tokens)
                for n in (cfg.overhead_prompt_tokens, 28_000)
            }
        for backend in backends:
            b: dict[str, Any] = {"direct": await run_direct(backend, cfg, f, rec)}
            if cfg.variants:
                b["variants"] = await run_variants(backend, cfg, f, rec)
                if backend == "sqlite":
                    async with rec.phase("sqlite: the ledger's SQL replayed without the driver"):
                        b["replay"] = await replay.capture_and_replay(f, cfg.workload)
                        b["replay"]["cpu_floor"] = replay.cpu_floor(cfg.workload)
            results["backends"][backend] = b
        if cfg.proxy:
            port = proxy.free_port()
            sim = proxy.ServerProcess(
                proxy.sim_command(port, cfg.workload.gen_tokens),
                port,
                "/health",
                logs / "sim.log",
            )
            with proxy.running(sim):
                for backend in backends:
                    b = results["backends"][backend]
                    b["proxy"] = await run_proxy(backend, cfg, f, rec, sim, logs)
                    if cfg.variants:
                        pv: dict[str, Any] = {}
                        pv["timed"] = await run_proxy_variant(
                            backend, "timed", cfg, f, rec, sim, logs, with_load=False
                        )
                        pv["flushintent"] = await run_proxy_variant(
                            backend, "flushintent", cfg, f, rec, sim, logs, with_load=False
                        )
                        if backend == "sqlite":
                            pv["nogroup"] = await run_proxy_variant(
                                backend, "nogroup", cfg, f, rec, sim, logs, with_load=True
                            )
                        b["proxy_variants"] = pv
        async with rec.phase("transport: JSON lists vs packed-v1"):
            results["transport"] = await transport.measure(f.tmp, quick=cfg.mode == "quick")
    finally:
        await f.cleanup()
    results["meta"]["duration_s"] = time.perf_counter() - rec.t0
    results["phases"] = rec.phases
    results["targets"] = report.evaluate(results)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure, write results JSON, regenerate the report")
    r.add_argument("--quick", action="store_true", help="smoke run on a tiny workload")
    r.add_argument("--backends", default="sqlite,postgres")
    r.add_argument("--no-proxy", action="store_true", help="skip the proxy phases")
    r.add_argument("--no-variants", action="store_true", help="skip the prototypes")
    r.add_argument("--out", type=Path, help="results JSON path")
    r.add_argument("--docs", type=Path, help="where the report and plots go")
    g = sub.add_parser("report", help="regenerate the report from a results JSON")
    g.add_argument("--results", type=Path, default=RESULTS / "full.json")
    g.add_argument("--docs", type=Path, default=DOCS)
    args = ap.parse_args()
    if args.cmd == "report":
        data = json.loads(args.results.read_text())
        report.write(data, args.docs, results_path=args.results)
        print(f"wrote {args.docs / 'performance-detail.md'}")
        return
    cfg = config(args.quick)
    cfg.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    cfg.proxy = not args.no_proxy
    cfg.variants = not args.no_variants
    base = RESULTS / "quick" if args.quick else RESULTS
    out_json = args.out or (base / ("quick.json" if args.quick else "full.json"))
    docs_dir = args.docs or (base if args.quick else DOCS)
    results = asyncio.run(run(cfg, out_json, docs_dir))
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    report.write(results, docs_dir, results_path=out_json)
    print(report.targets_text(results["targets"]))
    print(f"results: {out_json}\nreport:  {docs_dir / 'performance-detail.md'}")


if __name__ == "__main__":
    main()
