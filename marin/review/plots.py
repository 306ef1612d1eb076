"""Hand-written SVG line plots for the report, and the downsampling that keeps a 400,000-step run's
extremes (a one-step grad-norm spike must survive being drawn in 600 pixels)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


def downsample_minmax(xs: Sequence[float], ys: Sequence[float], buckets: int) -> tuple[list[float], list[float]]:
    """At most ``2 * buckets`` points of a series, keeping each bucket's lowest and highest point.

    The series is cut into ``buckets`` runs of consecutive points of (nearly) equal length; from each
    run the minimum and the maximum are kept, in their original order, so every spike and dip of the
    original appears in the plot and the global extremes are exact. Non-finite values are dropped
    (the report counts them separately). Short series come back unchanged.
    """
    if buckets <= 0:
        raise ValueError(f"buckets must be positive, got {buckets}")
    if len(ys) > 20 * buckets:
        return _downsample_numpy(xs, ys, buckets)
    pts = [(x, y) for x, y in zip(xs, ys) if _finite(y) and _finite(x)]
    if len(pts) <= 2 * buckets:
        return [p[0] for p in pts], [p[1] for p in pts]
    out_x: list[float] = []
    out_y: list[float] = []
    n = len(pts)
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        i_min = i_max = lo
        for i in range(lo + 1, hi):
            y = pts[i][1]
            if y < pts[i_min][1]:
                i_min = i
            if y > pts[i_max][1]:
                i_max = i
        for i in sorted({i_min, i_max}):
            out_x.append(pts[i][0])
            out_y.append(pts[i][1])
    return out_x, out_y


def _downsample_numpy(xs: Sequence[float], ys: Sequence[float], buckets: int) -> tuple[list[float], list[float]]:
    """:func:`downsample_minmax` for long series (same buckets, same points; numpy per bucket)."""
    def floats(vs: Sequence[float]) -> Any:
        try:
            return np.asarray(vs, dtype=np.float64)  # the common case: every value a number
        except (TypeError, ValueError):
            return np.array([v if _finite(v) else np.nan for v in vs], dtype=np.float64)

    x, y = floats(xs), floats(ys)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    n = len(y)
    if n <= 2 * buckets:
        return x.tolist(), y.tolist()
    idx: list[int] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        seg = y[lo:hi]
        i_min, i_max = lo + int(np.argmin(seg)), lo + int(np.argmax(seg))
        idx.extend(sorted({i_min, i_max}))
    return x[idx].tolist(), y[idx].tolist()


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        return f"{v:.2e}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.4g}"


def line_plot(title: str, series: dict[str, tuple[Sequence[float], Sequence[float]]], *,
              markers: Sequence[tuple[float, str]] = (), width: int = 640, height: int = 190,
              buckets: int = 600, y_label: str = "",
              points: dict[str, tuple[Sequence[float], Sequence[float]]] | None = None) -> str:
    """An inline ``<svg>`` line plot of named ``(x, y)`` series with vertical ``markers`` (x, label)
    and, optionally, named scatter ``points`` (drawn as dots, never downsampled: they are few).

    Each series is downsampled with :func:`downsample_minmax` first, so the SVG stays small whatever
    the run's length. A series whose x values are not increasing (a contour) is drawn as given.
    """
    def prepare(x, y):
        xs = list(x)
        if all(a <= b for a, b in zip(xs, xs[1:])):
            return downsample_minmax(x, y, buckets)
        pairs = [(a, b) for a, b in zip(xs, y) if _finite(a) and _finite(b)]
        return [a for a, _ in pairs], [b for _, b in pairs]

    data = {k: prepare(x, y) for k, (x, y) in series.items()}
    data = {k: v for k, v in data.items() if v[0]}
    dots = {k: ([a for a, b in zip(x, y) if _finite(a) and _finite(b)], [b for a, b in zip(x, y)
                                                                        if _finite(a) and _finite(b)])
            for k, (x, y) in (points or {}).items()}
    dots = {k: v for k, v in dots.items() if v[0]}
    if not data and not dots:
        return ""
    x_all = [x for xs, _ in (*data.values(), *dots.values()) for x in xs]
    y_all = [y for _, ys in (*data.values(), *dots.values()) for y in ys]
    x0, x1 = min(x_all), max(x_all)
    y0, y1 = min(y_all), max(y_all)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.05, y1 + (abs(y1) or 1) * 0.05
    left, right, top, bottom = 58, 10, 22, 26
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    parts = [(f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
              f'viewBox="0 0 {width} {height}" role="img"><title>{html.escape(title)}</title>'),
             f'<text x="{left}" y="14" class="pt">{html.escape(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="pf"/>']
    for frac in (0, 0.5, 1):
        yv = y0 + frac * (y1 - y0)
        parts.append(f'<text x="{left - 4}" y="{py(yv) + 4:.1f}" class="yl">{_fmt(yv)}</text>')
    for frac in (0, 0.25, 0.5, 0.75, 1):
        xv = x0 + frac * (x1 - x0)
        parts.append(f'<text x="{px(xv):.1f}" y="{height - 8}" class="xl">{_fmt(xv)}</text>')
    for x, label in markers:
        if x0 <= x <= x1:
            parts.append(f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{top}" y2="{top + ph}" class="mk"/>'
                         f'<text x="{px(x) + 3:.1f}" y="{top + 10}" class="ml">{html.escape(label)}</text>')
    for i, (name, (xs, ys)) in enumerate(data.items()):
        color = PALETTE[i % len(PALETTE)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.3" points="{pts}"/>')
        if len(data) > 1:
            parts.append(f'<text x="{left + pw - 4}" y="{top + 12 + 12 * i}" class="lg" fill="{color}">'
                         f'{html.escape(name)}</text>')
    for j, (name, (xs, ys)) in enumerate(dots.items()):
        color = PALETTE[(len(data) + j) % len(PALETTE)]
        parts.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>' for x, y in zip(xs, ys))
        parts.append(f'<text x="{left + pw - 4}" y="{top + 12 + 12 * (len(data) + j)}" class="lg" '
                     f'fill="{color}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)
