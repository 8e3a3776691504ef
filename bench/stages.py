"""Where a proxied call's time goes inside ``rollout-ledger serve``: wall and CPU per stage.

``python -m bench.stages [--samples N] [--prompt-tokens T] [--out FILE]`` starts the simulated
engine and one ``serve`` (SQLite) whose capture stages are wrapped with timers, sends it
``bench.proxy.overhead``'s calls (per rollout a root call and a continuation, one call at a
time), stops it, and prints per stage: how many calls, the wall time's p50 and mean, and the
mean CPU of the thread that ran it (the event loop's, or for the statements the writer
thread's when the batch ran there), with the server's whole CPU and minor page faults per
call.  Root calls and continuations are kept apart for the record (``record``, ``put``).

The calls go one at a time on purpose: an awaiting stage's thread CPU then is its own work (with
calls in flight together it would include theirs).  The wrappers cost a few microseconds per
stage, so the overhead printed is a little above ``python -m bench.proxy``'s: compare stages
with each other, and changes side by side, not this overhead with that one.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

__all__ = ["main", "stage_report"]

# Each stage's first observations are the process warming up (imports, first connections).
_SKIP = 10
# Rollouts sent before the timed ones (``bench.proxy.overhead``'s own warm-up).
_WARMUP = 3


def _install(out: Path) -> None:
    """In the ``serve`` child: wrap the capture stages; write what they measured at exit."""
    from api.proxy import capture as cap
    from api.proxy import routing
    from ledger.storage import capture as storage_capture
    from ledger.storage import ingest

    seen: set[tuple[str, str]] = set()
    stats: dict[str, list[tuple[float, float]]] = {}

    def keyed(label: str, split: int | None, args: tuple[Any, ...]) -> str:
        """``label``, or with ``split`` (the argument that carries the rollout id) the label
        of a root call or of a continuation: the rollout's first call here is its root."""
        if split is None:
            return label
        carrier = args[split] if len(args) > split else None
        if isinstance(carrier, dict):
            rid = str(carrier.get("rollout_id"))
        else:
            rid = str(getattr(carrier, "rollout_id", None))
        first = (label, rid) not in seen
        seen.add((label, rid))
        return label + (".root" if first else ".continuation")

    def note(key: str, t0: float, c0: float) -> None:
        stats.setdefault(key, []).append((time.perf_counter() - t0, time.thread_time() - c0))

    def timed_async(owner: Any, name: str, label: str, *, split: int | None = None) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = keyed(label, split, args)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return await fn(*args, **kwargs)
            finally:
                note(key, t0, c0)

        setattr(owner, name, wrapper)

    def timed(owner: Any, name: str, label: str, *, split: int | None = None) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = keyed(label, split, args)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                note(key, t0, c0)

        setattr(owner, name, wrapper)

    timed_async(cap, "capture", "capture (the whole handler)")
    routing.capture = cap.capture  # type: ignore[attr-defined]  # bound at import there
    timed_async(storage_capture.CaptureOps, "begin_call", "intent (begin_call)")
    timed_async(cap, "_call_upstream", "upstream call, answer parsed")
    timed_async(cap, "_record", "record", split=1)
    timed_async(storage_capture.CaptureOps, "put", "put", split=1)
    timed(cap, "strip_chat_response", "strip the answer")
    timed(cap, "extract_chat_tokens", "extract and check ids")
    timed(cap, "_as_response_items", "output items")
    timed(cap, "_known_prompt", "prompt-id cache")
    timed(cap, "continuation_fingerprint", "continuation fingerprint")
    timed(cap, "_checked_entry", "entry checks")
    timed(cap, "harness_answer", "harness answer")
    timed(ingest, "prepare", "pack and hash (prepare)", split=0)
    timed(ingest, "run_sqlite", "statements (run_sqlite)")

    def dump() -> None:
        out.write_text(json.dumps(stage_report(stats), indent=1) + "\n")

    atexit.register(dump)


def stage_report(stats: dict[str, list[tuple[float, float]]]) -> dict[str, dict[str, float]]:
    """Per stage (seconds in, milliseconds out): calls, wall p50 and mean, thread CPU mean;
    each stage's first observations left out as warm-up."""
    report: dict[str, dict[str, float]] = {}
    for label, rows in stats.items():
        kept = rows[_SKIP:] or rows
        report[label] = {
            "calls": len(kept),
            "wall_p50_ms": statistics.median(w for w, _ in kept) * 1e3,
            "wall_mean_ms": statistics.fmean(w for w, _ in kept) * 1e3,
            "cpu_mean_ms": statistics.fmean(c for _, c in kept) * 1e3,
        }
    return report


def _child(out: Path, serve_argv: list[str]) -> int:
    _install(out)
    from api.cli import app

    sys.argv = ["rollout-ledger", *serve_argv]
    app()
    return 0


def _minor_faults(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[7])


async def _run(samples: int, prompt_tokens: int) -> dict[str, Any]:
    from bench import proxy as bp

    async with bp._scratch("rl_stages_") as (tmp, dbs):
        stats_file = tmp / "stages.json"
        sim_port, port = bp.free_port(), bp.free_port()
        sim = bp.ServerProcess(bp.sim_command(sim_port, 300), sim_port, "/health", tmp / "sim.log")
        db_url = (await dbs.create("sqlite", "stages")).url
        serve = bp.serve_command(db_url, sim.url, port)
        child = [sys.executable, "-m", "bench.stages", "--child", str(stats_file), "--"]
        srv_log = tmp / "serve.log"
        srv = bp.ServerProcess([*child, *serve[serve.index("serve") :]], port, "/healthz", srv_log)
        with bp.running(sim), bp.running(srv):
            assert srv.proc is not None
            proc = psutil.Process(srv.proc.pid)
            cpu0, faults0 = sum(proc.cpu_times()[:2]), _minor_faults(proc.pid)
            overhead = await bp.overhead(
                srv.url,
                sim.url,
                samples=samples,
                prompt_tokens=prompt_tokens,
                tool_tokens=200,
                prefix="stages",
                warmup=_WARMUP,
            )
            calls = 2 * (samples + _WARMUP)  # a root and a continuation per rollout
            cpu_ms = (sum(proc.cpu_times()[:2]) - cpu0) * 1e3 / calls
            faults1 = _minor_faults(proc.pid)
        if not stats_file.exists():  # written at the child's exit: it did not exit cleanly
            raise RuntimeError(
                "serve stopped without writing its stage timings: "
                + srv_log.read_text(errors="replace")[-2000:]
            )
        stages = json.loads(stats_file.read_text())
    return {
        "samples": samples,
        "prompt_tokens": prompt_tokens,
        "overhead_p50_ms": {step: r["overhead_p50_ms"] for step, r in overhead.items()},
        "server_cpu_ms_per_call": cpu_ms,
        "minor_faults_per_call": (
            None if faults0 is None or faults1 is None else (faults1 - faults0) / calls
        ),
        "stages": stages,
    }


def _print(result: dict[str, Any]) -> None:
    oh = result["overhead_p50_ms"]
    faults = result["minor_faults_per_call"]
    print(
        f"{result['samples']} rollouts at {result['prompt_tokens']} prompt tokens: overhead p50 "
        f"root {oh['root']:.2f} ms, continuation {oh['continuation']:.2f} ms; server CPU "
        f"{result['server_cpu_ms_per_call']:.2f} ms/call"
        + ("" if faults is None else f", {faults:.0f} minor page faults/call")
    )
    print(f"{'stage':40s} {'calls':>6s} {'wall p50':>9s} {'mean':>8s} {'CPU mean':>9s}")
    for label, s in sorted(result["stages"].items(), key=lambda kv: -kv[1]["wall_mean_ms"]):
        print(
            f"{label:40s} {s['calls']:6d} {s['wall_p50_ms']:9.3f} {s['wall_mean_ms']:8.3f} "
            f"{s['cpu_mean_ms']:9.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:  # the serve process this tool starts
        return _child(Path(argv[1]), argv[3:])
    ap = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__)
    ap.add_argument("--samples", type=int, default=300, help="rollouts (two calls each)")
    ap.add_argument("--prompt-tokens", type=int, default=16_000)
    ap.add_argument("--out", type=Path, default=None, help="write the figures here (JSON)")
    args = ap.parse_args(argv)
    result = asyncio.run(_run(args.samples, args.prompt_tokens))
    _print(result)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
