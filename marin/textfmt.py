"""How numbers and tables read on a terminal: one duration, timestamp, size and table format for every
command.

A top-level helper (no marin imports), so the trainer's progress line, ``marin status``, ``marin
watch``, ``marin eval`` and the HTML report all print a duration and a table the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence


def format_duration(seconds: float | None) -> str:
    """``0m42s``, ``3m05s``, ``2h07m``; ``-`` when unknown (None, NaN, infinite)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(0, int(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_timestamp(t: float | None) -> str:
    """``2026-12-01 10:59:15`` in local time (a record's start, end or update); ``-`` when unknown."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def format_bytes(n: float) -> str:
    """``512 B``, ``3.5 KiB``, ``4.0 MiB``, ``1.2 GiB`` (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}


def parse_bytes(text: str | int | float) -> int:
    """``100TiB``, ``1.5 TB``, ``512GiB``, ``4096`` -> bytes (binary units with an ``i``, decimal without:
    storage vendors quote quotas both ways). A bad size raises ValueError naming the accepted units."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        raw = str(text).strip().replace(" ", "")
        split = len(raw) - len(raw.lstrip("0123456789.eE+-")) if raw else 0
        num, unit = raw[:split], raw[split:].upper()
        try:
            value = float(num)
        except ValueError:
            value = float("nan")
    if unit not in _SIZE_UNITS or not math.isfinite(value) or value < 0:
        raise ValueError(f"not a size: {text!r} (a number with B, KB, MB, GB, TB, PB or KiB, MiB, GiB, TiB, PiB)")
    return int(value * _SIZE_UNITS[unit])


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[int] = (),
                 rule: bool = True, indent: str = "") -> str:
    """Columns padded to their widest cell, two spaces apart; ``right`` lists the columns aligned
    right (numbers); ``rule`` puts a line of dashes under the header; ``indent`` starts every line
    (a table inside a report). An empty ``header`` gives a table without one (label, value pairs).
    A None cell reads ``-``."""
    ncols = len(header) or max((len(r) for r in rows), default=0)
    cells = ([[str(h) for h in header]] if header else []) + \
        [["-" if c is None else str(c) for c in r] + [""] * (ncols - len(r)) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(ncols)]

    def line(c: list[str]) -> str:
        return (indent + "  ".join(v.rjust(w) if i in right else v.ljust(w)
                                   for i, (v, w) in enumerate(zip(c, widths)))).rstrip()

    out = [line(c) for c in cells]
    if header and rule:
        out.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(out)
