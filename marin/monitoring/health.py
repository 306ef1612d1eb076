"""Run health from metrics records: pure checks against the published run's healthy ranges.

Used by ``marin health`` (an operator's command against a live or finished run) and
by the quickstart's final step. Checks, in the spirit of the published run's checklist ("first 3%: clear;
next window: the real grad-norm peak near 30%"): every value finite; loss falling; token drop
fraction on the send and receive side below 8%; per phase (sequence length x transport) of a
transport that can drop, its drop fraction within that transport's limit (fixed 8%,
ragged_capacity 0.1%); where the grad norm peaked and whether it crossed 4
(the ladder bug that z-loss fixed); recent MFU and throughput.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import fsspec

from marin.evaluation.suite import TASK_KEY
from marin.execution.versioning import input_field
from marin.scaling.ladder import GRAD_NORM_SMOOTH, read_fit, window_mean
from marin.training.metrics import phase_summary, read_metrics
from marin.training.run import Run
from marin.training.schedule import replan_horizon, schedule_from_config

HEALTHY_DROP = 0.08
# Per transport that can drop: the largest healthy drop fraction of a phase (send + receive side).
# The fixed transport's is the published run's 8%; the capacity-bounded ragged transport dropped
# 0.018% on the live hero, so above 0.1% its chunk capacity is too small for the routing (raise the
# capacity factor: `marin plan` says how far it still fits).
PHASE_DROP_LIMITS = {"fixed": HEALTHY_DROP, "ragged_capacity": 0.001}
GRAD_NORM_ALARM = 4.0
DIVERGED = re.compile(r"non-finite training signal at step (\d+)[^;]*")
"""How the trainer's NaN/Inf guard (``TrainingDiverged``) words the error a diverged run's step
records: the step that went non-finite is never logged to metrics.jsonl (nothing of it is kept), so
the metrics alone would read as a healthy run that ended early."""


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


def diverged_at(error: str | None) -> tuple[int, str] | None:
    """(step, the trainer's words) when a run's recorded error is its NaN/Inf guard stopping it; else None."""
    m = DIVERGED.search(error or "")
    return (int(m.group(1)), m.group(0)) if m else None


def run_outcome(run_path: str) -> dict[str, Any]:
    """What a run's records say beyond its metrics: its planned steps (the recorded config's final
    horizon, after any re-plan) and, when its last attempt stopped on a non-finite loss or grad norm,
    the trainer's words for it (``diverged``)."""
    run = Run(run_path.rstrip("/"))
    planned = run_schedule(run_path)[2]
    if planned is None:  # a config without a schedule of its own: its train_steps, if it records them
        steps = ((run.info or {}).get("config") or {}).get("train_steps")
        planned = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    found = diverged_at((run.info or {}).get("error"))
    return {"planned_steps": planned, "diverged": found[1] if found else None}


def health(records: list[dict[str, Any]], total_steps: int | None = None, window: float = 0.1, *,
           diverged: str | None = None) -> dict[str, Any]:
    """Pure check of a run's records; returns ``{"ok": bool, "checks": [...], "summary": {...}}``.

    ``window`` is the fraction of the logged records used as "first" and "recent" windows (at least 1).
    ``total_steps`` is the run's planned horizon (progress and the grad-norm peak are fractions of
    it; without it, of the last logged step). ``diverged``: the trainer's error when the run stopped
    on a non-finite value (:func:`run_outcome`): the step that diverged is not in the records, so
    the "finite" check fails with it.
    """
    if not records:
        checks = [{"name": "records", "ok": False, "detail": "no records"}]
        if diverged:
            checks.insert(0, {"name": "finite", "ok": False, "detail": f"diverged: {diverged}"})
        return {"ok": False, "checks": checks, "summary": {}}
    records = sorted(records, key=lambda r: r["step"])
    n = len(records)
    w = max(1, int(round(n * window)))
    first, recent = records[:w], records[-w:]
    last_step = records[-1]["step"]
    horizon = total_steps or last_step
    checks = []

    bad = [r["step"] for r in records for k in ("loss", "grad_norm") if not math.isfinite(_num(r.get(k)))]
    finite = "all logged loss/grad_norm values finite" if not bad else f"non-finite at steps {bad[:5]}"
    checks.append({"name": "finite", "ok": not bad and not diverged,
                   "detail": f"diverged: {diverged} ({finite.replace('all ', 'the ')} before it)" if diverged
                   else finite})

    loss_first, loss_recent = _mean([_num(r["loss"]) for r in first]), _mean([_num(r["loss"]) for r in recent])
    checks.append({"name": "loss_falling", "ok": n < 2 or loss_recent < loss_first,
                   "detail": f"loss {loss_first:.4f} (first {w}) -> {loss_recent:.4f} (last {w})"})

    for side in ("send", "recv"):
        key = f"drop_frac_{side}"
        early = _mean([_num(r.get(key, 0.0)) for r in first])
        late = _mean([_num(r.get(key, 0.0)) for r in recent])
        checks.append({"name": f"drop_{side}", "ok": late < HEALTHY_DROP,
                       "detail": f"{side} drop {100 * early:.2f}% early -> {100 * late:.2f}% recent (healthy < 8%)"})

    phases = phase_summary(records)
    for ph in phases:
        limit = PHASE_DROP_LIMITS.get(ph["transport"])
        if limit is None:
            continue
        frac = _num(ph["drop_frac_send"]) + _num(ph["drop_frac_recv"])
        checks.append({"name": f"drop_phase_{ph['seq_len']}_{ph['transport']}", "ok": not frac > limit,
                       "detail": f"L={ph['seq_len']} {ph['transport']} (steps {ph['first_step']}-{ph['last_step']}): "
                                 f"{100 * frac:.3f}% of assignments dropped (healthy <= {100 * limit:g}%)"})

    failed_saves = max(int(_num(r.get("checkpoint_failed_saves", 0)) or 0) for r in records)
    if failed_saves:  # training went on, but the run is exposed: say so until a person looks at the store
        first_failed = next(r["step"] for r in records if r.get("checkpoint_failed_saves"))
        checks.append({"name": "checkpoint_saves", "ok": False,
                       "detail": f"{failed_saves} permanent checkpoint save(s) failed (first seen at step "
                                 f"{first_failed}); training went on from the newest committed one: see the run's "
                                 "log for the objects or hosts that failed and why (checkpoint.max_failed_saves)"})

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
        "phases": phases,
        "planned_steps": total_steps,
        "diverged": diverged,
    }
    return {"ok": all(c["ok"] for c in checks), "checks": checks, "summary": summary}


def prediction_report(run_path: str, fit_path: str, total_steps: int | None = None, plan_mfu: float | None = None,
                      plan_tokens_per_s: float | None = None) -> dict[str, Any]:
    """:func:`health_vs_prediction` of a run directory (live or finished) against a fit.json."""
    fit = read_fit(fit_path)
    schedule, tokens_per_step, horizon = run_schedule(run_path)
    total = total_steps or horizon or int(fit["target"]["train_steps"])
    records = read_metrics(run_path, kind=None)
    train = [r for r in records if r.get("kind", "train") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    return health_vs_prediction(train, fit, total, eval_records=evals, plan_mfu=plan_mfu,
                                plan_tokens_per_s=plan_tokens_per_s, schedule=schedule, tokens_per_step=tokens_per_step)


def format_report(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = []
    if s:
        planned = s.get("planned_steps")
        of = f"of {planned:,} planned steps" if planned else "of horizon"
        lines.append(f"step {s['last_step']} ({s['progress_pct']:.1f}% {of}), loss {s['loss']:.4f}, "
                     f"L={s['seq_len']} {s['transport']}, {s['tokens_per_s_recent']:.0f} tok/s, "
                     f"mfu {100 * s['mfu_recent']:.2f}%" + (": DIVERGED, the run stopped" if s.get("diverged") else ""))
    for ph in s.get("phases") or []:
        lines.append(f"  phase L={ph['seq_len']} {ph['transport']}: steps {ph['first_step']}-{ph['last_step']}, "
                     f"drops {100 * _num(ph['drop_frac_send']):.3f}% send / "
                     f"{100 * _num(ph['drop_frac_recv']):.3f}% recv")
    for c in report["checks"]:
        lines.append(f"  [{'clear' if c['ok'] else 'ALERT'}] {c['name']}: {c['detail']}")
    diverged = next((c["detail"] for c in report["checks"] if c["name"] == "finite" and
                     c["detail"].startswith("diverged: ")), None)
    lines.append("overall: " + ("clear" if report["ok"] else "DIVERGED (a non-finite loss or grad norm stopped "
                                "the run)" if diverged else "needs a look"))
    if report.get("prediction"):
        lines.append(format_prediction_report(report["prediction"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- #
# against the ladder's prediction                                                                #
# --------------------------------------------------------------------------------------------- #
#
# A ladder fit (marin.scaling.ladder, fit.json) predicts the target run at fractions of its steps:
# loss / bpb with a band, the grad-norm peak position and drop fractions. The run is judged window
# by window (first 3%, 3-10%, 10-30%, ...), each item and each window at one of three levels:
#   clear  as predicted (or better);
#   watch  outside the band by up to twice its half-width, a grad-norm trend against the ladder's
#          shape, drops above 8% in the first window (the hero started at 10.4%), MFU / throughput
#          below 90% of plan;
#   act    further than twice the half-width above the band, grad norm above 4, drops above 8%
#          after the first window, MFU / throughput below 75% of plan.
# "act" in a window that ends within the first 25% of the run, while the run is still there,
# proposes the published run's contingency: shorten the horizon and re-plan the linear LR decay so it still
# ends at 5% of peak (the lr_replans value to pass to default_train).

LEVELS = ("clear", "watch", "act")
BAND_WATCH = 2.0
"""Beyond this many half-widths above the band, a value is "act" (between 1 and this: "watch")."""
PLAN_WATCH, PLAN_ACT = 0.9, 0.75
CONTINGENCY_BEFORE = 0.25
DEFAULT_SHORTEN = 0.8
"""Without a throughput shortfall to size it, the contingency keeps 80% of the remaining steps."""


def _worst(levels: list[str]) -> str:
    return max(levels, key=LEVELS.index) if levels else "clear"


def _window_label(lo: float, hi: float) -> str:
    return f"first {100 * hi:g}%" if lo == 0 else f"{100 * lo:g}-{100 * hi:g}%"


def _band_item(name: str, actual: float, pred: float | None, low: float | None, high: float | None) -> dict[str, Any]:
    if pred is None or low is None or high is None or not math.isfinite(actual):
        return {"name": name, "level": "clear", "text": f"{name} {actual:.4g} (no prediction)"}
    half = max((high - low) / 2, 1e-12)
    excess = (actual - high) / half  # only worse than predicted (higher) counts
    level = "clear" if excess <= 0 else "watch" if excess <= BAND_WATCH - 1 else "act"
    return {"name": name, "level": level, "actual": actual, "predicted": pred, "half_width": half,
            "text": f"{name} {actual:.4g} vs predicted {pred:.4g} +/- {half:.2g}"}


def _segment(records: list[dict[str, Any]], lo_step: int, hi_step: int) -> list[dict[str, Any]]:
    return [r for r in records if lo_step < r["step"] <= hi_step]


def health_vs_prediction(
    records: list[dict[str, Any]],
    fit: dict[str, Any],
    total_steps: int,
    *,
    eval_records: list[dict[str, Any]] | None = None,
    plan_mfu: float | None = None,
    plan_tokens_per_s: float | None = None,
    schedule: Any = None,
    tokens_per_step: int = 0,
) -> dict[str, Any]:
    """Judge a run (its training records, and in-training eval records) window by window against a
    ladder fit; pure. ``schedule`` (a :class:`marin.training.schedule.LRSchedule`) enables the
    contingency proposal. Returns ``{"windows": [...], "level", "next", "contingency", ...}``."""
    records = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
    evals = sorted(eval_records or [], key=lambda r: r["step"])
    if not records:
        return {"windows": [], "level": "clear", "next": "no training records yet", "contingency": None,
                "progress": 0.0}
    last = records[-1]["step"]
    progress = last / total_steps
    fractions = sorted(float(f) for f in fit["fractions"])
    preds = fit["predictions"]
    gn_peak_at = fit.get("grad_norm", {}).get("predicted_peak_fraction")
    windows = []
    prev = 0.0
    for f in fractions:
        step = max(1, round(f * total_steps))
        if last < step:
            break
        pred = preds[f"{f:g}"]
        items = []
        loss = window_mean(records, "loss", step, total_steps)
        items.append(_band_item("loss", loss, pred.get("loss"), pred.get("loss_low"), pred.get("loss_high")))
        near = [e for e in evals if abs(e["step"] - step) <= 0.05 * total_steps and "eval/macro_bpb" in e]
        if near and pred.get("bpb") is not None:
            e = min(near, key=lambda r: abs(r["step"] - step))
            items.append(_band_item("bpb", _num(e["eval/macro_bpb"]), pred.get("bpb"), pred.get("bpb_low"),
                                    pred.get("bpb_high")))
        seg = _segment(records, round(prev * total_steps), step)
        gn = [_num(r.get("grad_norm")) for r in seg]
        gn = [g for g in gn if math.isfinite(g)]
        if gn:
            gmax = max(gn)
            if gmax > GRAD_NORM_ALARM:
                items.append({"name": "grad_norm", "level": "act",
                              "text": f"grad norm reached {gmax:.3g} (> {GRAD_NORM_ALARM:g}, the z-loss bug's mark)"})
            else:
                k = max(1, round(GRAD_NORM_SMOOTH * total_steps))
                trend = _slope(gn[k:] if len(gn) > 2 * k else gn)
                expect_rise = gn_peak_at is not None and f <= gn_peak_at
                expect_fall = gn_peak_at is not None and prev >= gn_peak_at
                off = (expect_rise and trend < 0 and gn[-1] < 0.8 * max(gn)) or (
                    expect_fall and trend > 0 and gn[-1] > 1.25 * min(gn)
                )
                shape = ("rising" if trend > 0 else "falling") + (
                    "" if gn_peak_at is None else f", ladder peak near {100 * gn_peak_at:.0f}%")
                items.append(
                    {
                        "name": "grad_norm",
                        "level": "watch" if off else "clear",
                        "text": f"grad norm {gn[-1]:.3g} {shape}"
                        + (": departs from the ladder's shape" if off else ""),
                    }
                )
        for side in ("send", "recv"):
            d = window_mean(records, f"drop_frac_{side}", step, total_steps, width=max(0.005, (f - prev) / 2))
            if not math.isfinite(d):
                continue
            lvl = "clear" if d < HEALTHY_DROP else ("watch" if prev == 0 else "act")
            ladder_d = pred.get(f"drop_frac_{side}")
            extra = f", ladder {100 * ladder_d:.1f}%" if ladder_d is not None and math.isfinite(_num(ladder_d)) else ""
            items.append({"name": f"drop_{side}", "level": lvl, "text": f"{side} drops {100 * d:.1f}% (< 8%{extra})"})
        for key, plan, label in (("mfu", plan_mfu, "MFU"), ("tokens_per_s", plan_tokens_per_s, "throughput")):
            if plan is None:
                continue
            vals = [_num(r.get(key)) for r in seg[1:] or seg]
            vals = [v for v in vals if math.isfinite(v)]
            if not vals:
                continue
            ratio = _mean(vals) / plan
            lvl = "clear" if ratio >= PLAN_WATCH else "watch" if ratio >= PLAN_ACT else "act"
            items.append({"name": key, "level": lvl, "ratio_to_plan": ratio,
                          "text": f"{label} {100 * ratio:.0f}% of plan"})
        level = _worst([i["level"] for i in items])
        windows.append({"label": _window_label(prev, f), "from": prev, "to": f, "step": step, "level": level,
                        "items": items})
        prev = f
    nxt = next((f for f in fractions if round(f * total_steps) > last), None)
    if nxt is None:
        next_text = "run complete: every window judged"
    else:
        p = preds[f"{nxt:g}"]
        m = p.get("metric", "loss")
        next_text = f"next window ({_window_label(prev, nxt)}): {m} expected {p.get(m, float('nan')):.4g} " \
                    f"+/- {(p.get('high', 0) - p.get('low', 0)) / 2:.2g} at {100 * nxt:g}%"
        if gn_peak_at is not None:
            next_text += f"; grad-norm peak expected near {100 * gn_peak_at:.0f}%"
    contingency = None
    early_act = [w for w in windows if w["level"] == "act" and w["to"] <= CONTINGENCY_BEFORE]
    if early_act and progress <= CONTINGENCY_BEFORE:
        contingency = propose_contingency(records, total_steps, schedule, tokens_per_step, plan_tokens_per_s,
                                          reason=f"act in {early_act[-1]['label']}")
    return {"windows": windows, "level": _worst([w["level"] for w in windows]), "next": next_text,
            "contingency": contingency, "progress": progress, "last_step": last, "total_steps": total_steps,
            "target": fit.get("target", {}).get("name"), "tasks": task_predictions(fit, evals, total_steps)}


def task_predictions(fit: dict[str, Any], evals: list[dict[str, Any]], total_steps: int) -> list[dict[str, Any]]:
    """Per task the ladder fit predicts (``fit["tasks"][name]["target"]``: accuracy through task loss,
    for the end of the run), the prediction next to the run's latest measured value when its
    in-training eval records carry the task (:data:`marin.evaluation.suite.TASK_KEY`). Pure."""
    out = []
    for name, entry in sorted((fit.get("tasks") or {}).items()):
        pred = entry.get("target") or {}
        if pred.get("acc") is None:
            continue
        row: dict[str, Any] = {"task": name, "predicted_acc": pred["acc"], "acc_low": pred.get("acc_low"),
                               "acc_high": pred.get("acc_high"), "predicted_task_loss": pred.get("task_loss")}
        key = TASK_KEY.format(name=name, metric="acc")
        seen = [e for e in evals if key in e]
        if seen:
            last = max(seen, key=lambda e: e["step"])
            row.update({"measured_acc": _num(last[key]), "measured_step": last["step"],
                        "measured_task_loss": _num(last.get(TASK_KEY.format(name=name, metric="gold_bpb"))),
                        "at_fraction": last["step"] / total_steps})
        out.append(row)
    return out


def propose_contingency(records: list[dict[str, Any]], total_steps: int, schedule: Any, tokens_per_step: int,
                        plan_tokens_per_s: float | None, reason: str) -> dict[str, Any]:
    """A shorter horizon from the last logged step: sized by the throughput shortfall when there is
    one (the remaining steps at the achieved rate take the planned time), else 80% of what remains;
    with the run's schedule, the ``lr_replans`` value that still ends the LR at 5% of peak."""
    at = records[-1]["step"]
    keep = DEFAULT_SHORTEN
    tps = [_num(r.get("tokens_per_s")) for r in records[-max(1, len(records) // 10):]]
    tps = [t for t in tps if math.isfinite(t)]
    if plan_tokens_per_s and tps and _mean(tps) < plan_tokens_per_s:
        keep = max(0.5, _mean(tps) / plan_tokens_per_s)
    new_total = at + max(1, round((total_steps - at) * keep))
    out: dict[str, Any] = {"reason": reason, "at_step": at, "new_total_steps": new_total,
                           "keep_fraction_of_remaining": keep}
    if schedule is None:
        out["note"] = "the run's LR schedule is unknown here: run marin replan-lr to get lr_replans"
        return out
    if at < schedule.warmup_steps:
        out["note"] = f"still in warmup ({schedule.warmup_steps} steps): re-plan after it"
        return out
    out.update(replan_horizon(schedule, at, new_total, tokens_per_step))
    return out


def format_prediction_report(report: dict[str, Any]) -> str:
    """The checklist: one line per window, the next window, and the contingency when proposed."""
    head = (
        f"against the ladder's prediction for {report.get('target')} "
        f"(step {report.get('last_step', 0)}, {100 * report.get('progress', 0):.1f}% of {report.get('total_steps')}):"
    )
    lines = [head]
    for w in report["windows"]:
        parts = [i["text"] + ("" if i["level"] == "clear" else f": {i['level'].upper()}") for i in w["items"]]
        lines.append(f"  {w['label']}: {w['level']} ({'; '.join(parts)})")
    lines.append(f"  {report['next']}")
    for t in report.get("tasks") or []:
        band = (f" [{t['acc_low']:.3f}, {t['acc_high']:.3f}]" if t.get("acc_low") is not None
                and t.get("acc_high") is not None else "")
        line = f"  task {t['task']}: accuracy predicted {t['predicted_acc']:.3f}{band} at the end of the run"
        if "measured_acc" in t:
            line += (f"; measured {t['measured_acc']:.3f} at step {t['measured_step']:,} "
                     f"({100 * t['at_fraction']:.0f}% of the run)")
        lines.append(line)
    c = report.get("contingency")
    if c:
        lines.append(
            f"  contingency ({c['reason']} within the first {100 * CONTINGENCY_BEFORE:g}%): shorten the horizon "
            f"to {c['new_total_steps']:,} steps from step {c['at_step']:,}"
        )
        if "lr_replans" in c:
            replans = tuple(tuple(r) for r in c["lr_replans"])
            lines.append(f"    the optimizer's lr_replans={replans} in default_train(...): the LR still decays "
                         f"linearly to 5% of peak, now at step {c['new_total_steps']:,}")
        if "note" in c:
            lines.append(f"    {c['note']}")
    return "\n".join(lines)


def run_schedule(run_path: str) -> tuple[Any, int, int | None]:
    """(LR schedule, tokens per step, final horizon) of a run from its recorded config (the step's
    status record), or from its latest checkpoint's metadata; (None, 0, None) when neither is there yet."""
    try:
        config = Run(run_path).recorded_config
    except Exception:  # noqa: BLE001 - a damaged checkpoint record: the report says what it can without it
        config = None
    if not config or "peak_lr" not in (config.get("optimizer") or {}):
        return None, 0, None
    sched = schedule_from_config(config)
    return sched, int(config.get("tokens_per_step", 0)), sched.final_total_steps


# --------------------------------------------------------------------------------------------- #
# as an executor step                                                                            #
# --------------------------------------------------------------------------------------------- #



@dataclasses.dataclass(frozen=True)
class HealthReportConfig:
    run_path: str = input_field()
    """A training step's output directory (holding metrics.jsonl)."""
    output_path: str = input_field()
    total_steps: int | None = None
    fit_path: str | None = input_field(default=None)
    """A ladder fit step's directory (fit.json): judge the run against its prediction too."""
    plan_mfu: float | None = None
    plan_tokens_per_s: float | None = None


def health_report_step(config: HealthReportConfig) -> dict[str, Any]:
    """Write ``health.json`` for a finished training step (``format_report`` renders it); with a
    ladder fit, ``report["prediction"]`` holds the window-by-window checklist."""
    outcome = run_outcome(config.run_path)
    report = health(read_metrics(config.run_path), config.total_steps or outcome["planned_steps"],
                    diverged=outcome["diverged"])
    if config.fit_path:
        report["prediction"] = prediction_report(config.run_path, config.fit_path, config.total_steps,
                                                 config.plan_mfu, config.plan_tokens_per_s)
    with fsspec.open(f"{config.output_path}/health.json", "w") as f:
        json.dump(report, f, indent=1)
    return report
