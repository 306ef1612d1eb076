"""Run health from metrics records: pure checks against the seed's healthy ranges.

Used by ``operations/health_report.py`` (an operator's command against a live or finished run) and
by the quickstart's final step. Checks, in the spirit of the seed's checklist ("first 3%: clear;
next window: the real grad-norm peak near 30%"): every value finite; loss falling; token drop
fraction on the send and receive side below 8%; where the grad norm peaked and whether it crossed 4
(the ladder bug that z-loss fixed); recent MFU and throughput.
"""

from __future__ import annotations

import math
from typing import Any

HEALTHY_DROP = 0.08
GRAD_NORM_ALARM = 4.0


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _slope(ys: list[float]) -> float:
    """Least-squares slope per record; 0 for fewer than two points."""
    n = len(ys)
    if n < 2:
        return 0.0
    xm, ym = (n - 1) / 2, _mean(ys)
    num = sum((i - xm) * (y - ym) for i, y in enumerate(ys))
    den = sum((i - xm) ** 2 for i in range(n))
    return num / den


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def health(records: list[dict[str, Any]], total_steps: int | None = None, window: float = 0.1) -> dict[str, Any]:
    """Pure check of a run's records; returns ``{"ok": bool, "checks": [...], "summary": {...}}``.

    ``window`` is the fraction of the logged records used as "first" and "recent" windows (at least 1).
    """
    if not records:
        return {"ok": False, "checks": [{"name": "records", "ok": False, "detail": "no records"}], "summary": {}}
    records = sorted(records, key=lambda r: r["step"])
    n = len(records)
    w = max(1, int(round(n * window)))
    first, recent = records[:w], records[-w:]
    last_step = records[-1]["step"]
    horizon = total_steps or last_step
    checks = []

    bad = [r["step"] for r in records for k in ("loss", "grad_norm") if not math.isfinite(_num(r.get(k)))]
    checks.append({"name": "finite", "ok": not bad,
                   "detail": "all loss/grad_norm values finite" if not bad else f"non-finite at steps {bad[:5]}"})

    loss_first, loss_recent = _mean([_num(r["loss"]) for r in first]), _mean([_num(r["loss"]) for r in recent])
    checks.append({"name": "loss_falling", "ok": n < 2 or loss_recent < loss_first,
                   "detail": f"loss {loss_first:.4f} (first {w}) -> {loss_recent:.4f} (last {w})"})

    for side in ("send", "recv"):
        key = f"drop_frac_{side}"
        early = _mean([_num(r.get(key, 0.0)) for r in first])
        late = _mean([_num(r.get(key, 0.0)) for r in recent])
        checks.append({"name": f"drop_{side}", "ok": late < HEALTHY_DROP,
                       "detail": f"{side} drop {100 * early:.2f}% early -> {100 * late:.2f}% recent (healthy < 8%)"})

    gn = [_num(r["grad_norm"]) for r in records]
    peak_i = max(range(n), key=lambda i: gn[i] if math.isfinite(gn[i]) else -1)
    peak_pct = 100.0 * records[peak_i]["step"] / horizon
    trend = _slope(gn[-w:]) if w > 1 else 0.0
    checks.append({"name": "grad_norm", "ok": max(gn) < GRAD_NORM_ALARM,
                   "detail": f"peak {gn[peak_i]:.3f} at step {records[peak_i]['step']} ({peak_pct:.1f}% of horizon); "
                             f"recent trend {trend:+.4f}/record ({'rising' if trend > 0 else 'falling or flat'}); "
                             f"alarm above {GRAD_NORM_ALARM}"})

    summary = {
        "last_step": last_step,
        "progress_pct": 100.0 * last_step / horizon,
        "loss": _num(records[-1]["loss"]),
        "grad_norm_peak": gn[peak_i],
        "grad_norm_peak_pct": peak_pct,
        "grad_norm_trend": trend,
        "mfu_recent": _mean([_num(r.get("mfu", float("nan"))) for r in recent]),
        "tokens_per_s_recent": _mean([_num(r.get("tokens_per_s", float("nan"))) for r in recent]),
        "seq_len": records[-1].get("seq_len"),
        "transport": records[-1].get("transport"),
    }
    return {"ok": all(c["ok"] for c in checks), "checks": checks, "summary": summary}


def format_report(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = []
    if s:
        lines.append(f"step {s['last_step']} ({s['progress_pct']:.1f}% of horizon), loss {s['loss']:.4f}, "
                     f"L={s['seq_len']} {s['transport']}, {s['tokens_per_s_recent']:.0f} tok/s, "
                     f"mfu {100 * s['mfu_recent']:.2f}%")
    for c in report["checks"]:
        lines.append(f"  [{'clear' if c['ok'] else 'ALERT'}] {c['name']}: {c['detail']}")
    lines.append("overall: " + ("clear" if report["ok"] else "needs a look"))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- #
# as an executor step                                                                            #
# --------------------------------------------------------------------------------------------- #

import dataclasses  # noqa: E402


@dataclasses.dataclass(frozen=True)
class HealthReportConfig:
    run_path: str
    """A training step's output directory (holding metrics.jsonl)."""
    output_path: str
    total_steps: int | None = None


def health_report_step(config: HealthReportConfig) -> dict[str, Any]:
    """Write ``health.json`` for a finished training step (``format_report`` renders it)."""
    import json

    import fsspec

    from marin.training.metrics import read_metrics

    report = health(read_metrics(config.run_path), config.total_steps)
    with fsspec.open(f"{config.output_path}/health.json", "w") as f:
        json.dump(report, f, indent=1)
    return report
