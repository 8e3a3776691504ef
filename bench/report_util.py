"""Formatting helpers shared by the report and its prose."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["NAMES", "fmt", "get"]

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
