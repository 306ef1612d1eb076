"""Health judged against a ladder fit: windows, levels, the next window, the contingency, the CLI
on a live (growing) metrics.jsonl, and the health step with a fit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from marin.cli import main as marin
from marin.monitoring.health import (
    HealthReportConfig,
    format_prediction_report,
    health_report_step,
    health_vs_prediction,
)
from marin.training.schedule import LRSchedule, lr_at

REPO = Path(__file__).resolve().parents[2]
TOTAL = 1000
FRACTIONS = (0.03, 0.1, 0.3, 0.5, 1.0)


def _expected_loss(f: float) -> float:
    return 2.0 + 3.0 * (f + 0.01) ** -0.3 / 10


def _fit() -> dict:
    preds = {}
    for f in FRACTIONS:
        m = _expected_loss(f)
        preds[f"{f:g}"] = {"loss": m, "loss_low": m - 0.05, "loss_high": m + 0.05, "metric": "loss",
                           "low": m - 0.05, "high": m + 0.05, "drop_frac_send": 0.02, "drop_frac_recv": 0.02}
    return {"target": {"name": "hero", "train_steps": TOTAL}, "fractions": list(FRACTIONS), "predictions": preds,
            "grad_norm": {"predicted_peak_fraction": 0.3, "predicted_peak": 1.5}}


def _records(last: int, *, loss_shift: float = 0.0, gn_scale: float = 1.0, drop: float = 0.02, mfu: float = 0.2):
    out = []
    for s in range(1, last + 1):
        f = s / TOTAL
        gn = gn_scale * (0.5 + f / 0.3 if f <= 0.3 else 1.5 - (f - 0.3))  # rises to 30%, then falls
        out.append({"step": s, "loss": _expected_loss(f) + loss_shift, "grad_norm": gn, "drop_frac_send": drop,
                    "drop_frac_recv": drop, "mfu": mfu, "tokens_per_s": 1000.0 * mfu / 0.2})
    return out


def test_a_run_on_its_prediction_is_clear_and_says_what_comes_next():
    rep = health_vs_prediction(_records(120), _fit(), TOTAL, plan_mfu=0.2)
    assert [w["label"] for w in rep["windows"]] == ["first 3%", "3-10%"]
    assert rep["level"] == "clear" and rep["contingency"] is None
    assert "grad-norm peak expected near 30%" in rep["next"] and "10-30%" in rep["next"]
    text = format_prediction_report(rep)
    assert "first 3%: clear (loss" in text and "vs predicted" in text and "+/- 0.05" in text


def test_levels_from_the_band_grad_norm_drops_and_plan():
    fit = _fit()
    watch = health_vs_prediction(_records(40, loss_shift=0.08), fit, TOTAL)  # 0.6 half-widths past the band
    assert watch["windows"][0]["level"] == "watch"
    act = health_vs_prediction(_records(40, loss_shift=0.5), fit, TOTAL)
    assert act["windows"][0]["level"] == "act"
    assert "ACT" in format_prediction_report(act)
    better = health_vs_prediction(_records(40, loss_shift=-0.5), fit, TOTAL)  # lower loss is never a problem
    assert better["level"] == "clear"
    spike = health_vs_prediction(_records(40, gn_scale=8.0), fit, TOTAL)
    assert any(i["name"] == "grad_norm" and i["level"] == "act" for i in spike["windows"][0]["items"])
    drops = health_vs_prediction(_records(150, drop=0.10), fit, TOTAL)
    assert [w["level"] for w in drops["windows"]] == ["watch", "act"]  # > 8%: watch at the start, act later
    slow = health_vs_prediction(_records(40, mfu=0.1), fit, TOTAL, plan_mfu=0.2)
    assert any(i["name"] == "mfu" and i["level"] == "act" for i in slow["windows"][0]["items"])
    # grad norm falling well before the ladder's peak (30%) departs from its shape
    falling = _records(120)
    for r in falling:
        r["grad_norm"] = 2.0 - r["step"] / 100
    off = health_vs_prediction(falling, fit, TOTAL)
    assert any(i["name"] == "grad_norm" and i["level"] == "watch" for w in off["windows"] for i in w["items"])


def test_act_in_the_first_quarter_proposes_a_shorter_horizon_ending_at_5_percent_of_peak():
    sched = LRSchedule(peak_lr=1e-3, warmup_steps=10, total_steps=TOTAL)
    rep = health_vs_prediction(_records(110, loss_shift=0.5), _fit(), TOTAL, schedule=sched, tokens_per_step=4096,
                               plan_tokens_per_s=2000.0)
    c = rep["contingency"]
    assert c["at_step"] == 110 and c["keep_fraction_of_remaining"] == pytest.approx(0.5)  # half the planned rate
    assert c["new_total_steps"] == 110 + 445
    [[at, new_total]] = c["lr_replans"]
    replanned = sched.replanned(at, new_total)
    assert lr_at(new_total, replanned) == pytest.approx(0.05 * 1e-3)
    assert lr_at(at, replanned) == pytest.approx(lr_at(at, sched))  # continuous at the switch
    assert "lr_replans=((110, 555),)" in format_prediction_report(rep)
    late = health_vs_prediction(_records(400, loss_shift=0.5), _fit(), TOTAL, schedule=sched)
    assert late["level"] == "act" and late["contingency"] is None  # past 25%: no horizon contingency


def test_cli_on_a_live_run_reads_the_growing_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "fit").mkdir()
    (tmp_path / "fit" / "fit.json").write_text(json.dumps(_fit()))
    lines = [json.dumps(r) for r in _records(50)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:20])  # a line being written
    assert marin(["health", str(run), "--fit", str(tmp_path / "fit"), "--total-steps", str(TOTAL)]) == 0
    out = capsys.readouterr().out
    assert "first 3%: clear" in out and "3-10%" not in out.split("next window")[0]
    with open(run / "metrics.jsonl", "a") as f:  # the run goes on (the partial line completes)
        f.write(lines[0][20:] + "\n" + "\n".join(json.dumps(r) for r in _records(320, loss_shift=0.5)[50:]) + "\n")
    assert marin(["health", str(run), "--fit", str(tmp_path / "fit"), "--total-steps", str(TOTAL), "--strict"]) == 1
    out = capsys.readouterr().out
    assert "10-30%: act" in out and "next window (30-50%)" in out


def test_health_step_with_a_fit(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(60)))
    (tmp_path / "fit.json").write_text(json.dumps(_fit()))
    out = tmp_path / "health"
    out.mkdir()
    rep = health_report_step(HealthReportConfig(str(run), str(out), TOTAL, fit_path=str(tmp_path / "fit.json")))
    saved = json.loads((out / "health.json").read_text())
    assert saved["prediction"]["windows"][0]["label"] == "first 3%" == rep["prediction"]["windows"][0]["label"]
    assert math.isclose(saved["prediction"]["progress"], 0.06)
