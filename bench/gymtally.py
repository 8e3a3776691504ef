"""Issue 12's targets over several ``python -m bench.gymcmp`` runs: how often each was met.

On a shared 2-vCPU machine one run's verdict moves with the minute it ran in (the simulated
engine alone answered the same request twice as slowly from one minute to the next), so a
single run says little about a target near its goal.  This reads the runs' JSON files (each
``gymcmp --out FILE``) and prints, per target, every run's value, the median and how many runs
met it (the goals and the verdict rule are the published page's, ``bench.gymreport.GOALS``).

    python -m bench.gymtally run1.json run2.json ... [--out bench/results/gymtally.json]

``--out`` keeps the per-run values (with each run's time, commit and Gym's own calls/s) as JSON,
small enough to commit beside the published run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.gymreport import GOALS, verdicts

__all__ = ["tally"]


def tally(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per target (in ``GOALS`` order): the goal, each run's value (None: not measured), the
    median of the measured ones and how many of them met the goal."""
    per_run = [verdicts(g) for g in runs]
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
            }
            for g in runs
        ],
        "targets": targets,
    }


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
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
