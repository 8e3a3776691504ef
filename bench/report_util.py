"""Formatting and plotting helpers shared by the reports and their prose."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["NAMES", "fmt", "get", "pyplot", "save_plot"]

NAMES = {"sqlite": "SQLite", "postgres": "Postgres"}


def get(d: Any, *path: Any) -> Any:
    """``d[p0][p1]...`` or None where any step is missing."""
    for p in path:
        if isinstance(d, dict):
            d = d.get(p)
        elif isinstance(d, list) and isinstance(p, int) and -len(d) <= p < len(d):
            d = d[p]
        else:
            return None
    return d


def fmt(x: Any, nd: int = 1, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}{unit}"
    return f"{x:,.{nd}f}{unit}"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (matplotlib is a bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(plt: Any, fig: Any, out: Path, name: str, names: list[str]) -> None:
    """Lay out, save (``out/name``, 110 dpi) and close a figure, and add its name to ``names``."""
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    names.append(name)
