"""Issue 12's targets over several ``python -m bench.gymcmp`` runs: how often each was met.

On a shared 2-vCPU machine one run's verdict moves with the minute it ran in (the simulated
engine alone answered the same request twice as slowly from one minute to the next), so a
single run says little about a target near its goal.  This reads the runs' JSON files (each
``gymcmp --out FILE``) and prints, per target, every run's value, the median and how many runs
met it (the goals and the verdict rule are the published page's, ``bench.gymreport.GOALS``).

    python -m bench.gymtally run1.json run2.json ... [--out bench/results/gymtally.json]

``--out`` keeps the per-run values (with each run's time, commit, Gym's own calls/s, fsync p50
and CPU probe) as JSON, small enough to commit beside the published run; ``by_cpu`` sets each
target against the CPU probe over the runs that recorded one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.gymreport import GOALS, verdicts

__all__ = ["by_cpu", "cpu_loop_ms", "spearman", "tally"]


def tally(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per target (in ``GOALS`` order): the goal, each run's value (None: not measured), the
    median of the measured ones and how many of them met the goal."""
    per_run = [verdicts(g) for g in runs]
    speeds = [cpu_loop_ms(g) for g in runs]
    targets: dict[str, Any] = {}
    for name, (goal, _meets) in GOALS.items():
        values = [v.get(name) for v in per_run]
        measured = [x for x in values if x is not None]
        if not measured:
            continue
        targets[name] = {
            "goal": goal,
            "values": [None if x is None else x[0] for x in values],
            "median": statistics.median(x[0] for x in measured),
            "met": sum(1 for x in measured if x[1]),
            "runs": len(measured),
        }
    return {
        "runs": [
            {
                "generated": g.get("generated"),
                "commit": ((g.get("machine") or {}).get("git") or {}).get("commit"),
                # The interpreter both stores ran on (Gym's own and the ledger, one process).
                "python": (g.get("machine") or {}).get("python"),
                "gym_best_calls_per_s": (g.get("ratios") or {})
                .get("sqlite", {})
                .get("gym_best_calls_per_s"),
                "fsync_p50_ms": (g.get("fsync_start") or {}).get("p50_ms"),
                "cpu_loop_ms": speed,
            }
            for g, speed in zip(runs, speeds, strict=True)
        ],
        "targets": targets,
        "by_cpu": by_cpu(per_run, speeds),
    }


def cpu_loop_ms(g: dict[str, Any]) -> float | None:
    """The run's CPU probe (``bench.machine.cpu_probe``: its pure-Python loop), the mean of its
    start and end readings; None for a run from before the probe."""
    readings = [
        p["python_loop_ms"]
        for p in ((g.get("machine") or {}).get("cpu_probe"), g.get("cpu_probe_end"))
        if p
    ]
    return statistics.fmean(readings) if readings else None


def by_cpu(
    per_run: list[dict[str, tuple[float, bool]]], speeds: list[float | None]
) -> dict[str, Any]:
    """Per target, how its value moved with the machine's speed over the runs that probed it:
    Spearman's rank correlation with the probe's loop time (+1: the slower the machine, the
    higher the value), and how often it was met on the faster and the slower half of them."""
    out: dict[str, Any] = {}
    for name in GOALS:
        pairs = [
            (speed, v[name])
            for v, speed in zip(per_run, speeds, strict=True)
            if speed is not None and name in v
        ]
        if len(pairs) < 4:
            continue
        pairs.sort(key=lambda p: p[0])
        half = len(pairs) // 2
        fast, slow = pairs[:half], pairs[len(pairs) - half :]
        out[name] = {
            "runs": len(pairs),
            "rho": spearman([p[0] for p in pairs], [p[1][0] for p in pairs]),
            "met_faster_half": sum(1 for p in fast if p[1][1]),
            "met_slower_half": sum(1 for p in slow if p[1][1]),
            "half": half,
        }
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None when either side is
    constant."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if not sxx or not syy:
        return None
    return float(sxy / (sxx * syy) ** 0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gymtally", description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="gymcmp JSON files, oldest first")
    ap.add_argument("--out", type=Path, default=None, help="also write the tally here (JSON)")
    args = ap.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            return 2
    out = tally(runs)
    pythons = sorted({str(r["python"]) for r in out["runs"]})
    if len(pythons) > 1:
        print(f"note: these runs mix interpreters ({', '.join(pythons)})", file=sys.stderr)
    width = max(len(n) for n in out["targets"]) if out["targets"] else 10
    for name, t in out["targets"].items():
        values = " ".join("-" if v is None else f"{v:.2f}" for v in t["values"])
        print(
            f"{name:<{width}}  {t['goal']:<9}  met {t['met']}/{t['runs']}  "
            f"median {t['median']:.2f}  [{values}]"
        )
    if out["by_cpu"]:
        print("against the machine's speed (CPU probe's loop ms; rho > 0: higher when slower):")
        for name, c in out["by_cpu"].items():
            rho = "n/a" if c["rho"] is None else f"{c['rho']:+.2f}"
            print(
                f"  {name:<{width}}  rho {rho}  met {c['met_faster_half']}/{c['half']} on the "
                f"faster half, {c['met_slower_half']}/{c['half']} on the slower"
            )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
