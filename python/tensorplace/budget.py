"""Budgets: bytes, or strings like "6GiB", "512 MiB", "1.5GB"."""

from __future__ import annotations

import re
from typing import Union

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}

Budget = Union[int, float, str]


def parse_budget(budget: Budget) -> int:
    """Bytes from an int, or a string with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).

    >>> parse_budget("6GiB")
    6442450944
    >>> parse_budget("1.5 GB")
    1500000000
    >>> parse_budget(1024)
    1024
    """
    if isinstance(budget, bool):
        raise TypeError("budget must be a number of bytes or a string like '6GiB', not a bool")
    if isinstance(budget, (int, float)):
        if budget != budget or budget <= 0 or budget == float("inf"):
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        return int(budget)
    if not isinstance(budget, str):
        raise TypeError(f"budget must be bytes (int) or a string like '6GiB', got {type(budget).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", budget)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read budget {budget!r}: write a number with an optional unit, e.g. '6GiB', '512MiB', '2GB' or 1073741824"
        )
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"budget must be positive, got {budget!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Human-readable bytes in binary units.

    >>> format_bytes(3 * 1024**2)
    '3.0 MiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
