"""The ladder fit step on rungs whose metrics follow a known law (no training needed)."""

from __future__ import annotations

import json
import math

import pytest

from marin.models.config import get_preset
from marin.scaling.fit import within_band
from marin.scaling.ladder import (
    LadderFitConfig,
    LadderFitError,
    RungRun,
    ladder_fit_step,
    rung_values,
)
from marin.scaling.recipe import run_flops, rung_model

TARGET = get_preset("tiny", head_dim=8, n_heads=8, n_kv_heads=4)
PHASES = ((0.0, 64), (0.5, 128))
E, A, ALPHA = 1.5, 40.0, 0.12


def _run(d: int, steps: int, root=None) -> RungRun:
    return RungRun(name=f"d{d}", model=rung_model(TARGET, d, 2), train_steps=steps, tokens_per_step=4096,
                   seq_len_phases=PHASES, warmup_steps=max(1, steps // 20),
                   run_path=None if root is None else str(root / f"d{d}"))


def _write(run: RungRun, root, bpb_scale: float | None = 0.8):
    """metrics.jsonl where loss at step s is the law at the compute spent so far; grad norm peaking
    at 30%; eval.json with bpb = scale x final loss."""
    d = root / run.name
    d.mkdir()
    lines = []
    for s in range(1, run.train_steps + 1):
        f = s / run.train_steps
        loss = E + A * run.flops_until(s) ** -ALPHA
        gn = 0.3 + (f / 0.3 if f <= 0.3 else 1 - (f - 0.3))
        lines.append(json.dumps({"step": s, "tokens": 4096 * s, "loss": loss, "grad_norm": gn,
                                 "drop_frac_send": 0.01, "drop_frac_recv": 0.005}))
        if bpb_scale is not None and s % max(1, run.train_steps // 20) == 0:  # in-training eval, every 5%
            lines.append(
                json.dumps({"step": s, "tokens": 4096 * s, "kind": "eval", "eval/macro_bpb": bpb_scale * loss})
            )
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if bpb_scale is not None:
        (root / f"{run.name}-eval").mkdir()
        (root / f"{run.name}-eval" / "eval.json").write_text(
            json.dumps({"macro_bpb": bpb_scale * (E + A * run.flops**-ALPHA)})
        )
        return RungRun(**{**run.__dict__, "eval_path": str(root / f"{run.name}-eval")})
    return run


def test_flops_until_matches_the_run_total():
    r = _run(32, 101)
    assert r.flops_until(r.train_steps) == pytest.approx(run_flops(r.model, 101, 4096, PHASES))
    assert r.flops_until(0) == 0 and r.flops_until(50) < r.flops / 2 < r.flops_until(51) * 1.1


def test_fit_step_predicts_a_rung_it_did_not_see(tmp_path):
    # five rungs: the saturating law can be tested by leaving the largest out (select_law), and wins
    rungs = [_write(_run(d, s, tmp_path), tmp_path) for d, s in [(16, 60), (32, 90), (48, 130), (64, 180), (80, 240)]]
    val = _write(_run(96, 300, tmp_path), tmp_path)
    out = tmp_path / "fit"
    out.mkdir()
    result = ladder_fit_step(LadderFitConfig(rungs=tuple(rungs), target=_run(96, 300), output_path=str(out),
                                             validation=val, n_boot=50, max_validation_rel_error=0.01))
    doc = json.loads((out / "fit.json").read_text())
    assert doc["metric"] == "bpb" and result["validation_rel_error"] == doc["validation_rel_error"]
    assert abs(doc["validation_rel_error"]) < 0.01 and abs(doc["loo_rel_error"]) < 0.01
    assert doc["params"]["loss"]["r2"] > 0.999
    p1 = doc["predictions"]["1"]
    assert p1["low"] <= p1["bpb"] <= p1["high"] and p1["loss_low"] <= p1["loss"] <= p1["loss_high"]
    truth_10 = E + A * _run(96, 300).flops_until(30) ** -ALPHA
    assert doc["predictions"]["0.1"]["loss"] == pytest.approx(truth_10, rel=0.02)  # the trajectory, not only the end
    # bpb at fractions comes from the in-training eval records (kind "eval")
    assert doc["predictions"]["0.1"]["bpb"] == pytest.approx(0.8 * truth_10, rel=0.03)
    assert doc["rungs"][0]["at"]["0.5"]["bpb"] == pytest.approx(0.8 * doc["rungs"][0]["at"]["0.5"]["loss"], rel=0.02)
    assert doc["grad_norm"]["predicted_peak_fraction"] == pytest.approx(0.3, abs=0.03)
    assert all(r["grad_norm_shape"]["peak_fraction"] == pytest.approx(0.3, abs=0.03) for r in doc["rungs"])
    assert doc["drop_frac"]["0.3"]["predicted"] == pytest.approx(0.01)
    assert sorted(doc["plots"]) == ["drops.png", "fit_bpb.png", "grad_norm.png", "trajectory.png"]
    assert all((out / p).read_bytes()[:4] == b"\x89PNG" for p in doc["plots"])
    assert "NaN" not in (out / "fit.json").read_text()


def test_a_validation_miss_beyond_the_tolerance_fails_after_writing(tmp_path):
    rungs = [_write(_run(d, s, tmp_path), tmp_path, None) for d, s in [(16, 60), (32, 90), (48, 130)]]
    val = _write(_run(96, 300, tmp_path), tmp_path, None)
    lines = (tmp_path / "d96" / "metrics.jsonl").read_text().splitlines()
    worse = [json.dumps({**json.loads(x), "loss": json.loads(x)["loss"] * 1.2}) for x in lines]
    (tmp_path / "d96" / "metrics.jsonl").write_text("\n".join(worse) + "\n")
    out = tmp_path / "check"
    out.mkdir()
    with pytest.raises(LadderFitError, match=r"validation rung d96: loss predicted .*\(-1\d\.\d%, limit 5%\)"):
        ladder_fit_step(LadderFitConfig(rungs=tuple(rungs), target=_run(96, 300), output_path=str(out),
                                        validation=val, n_boot=20, max_validation_rel_error=0.05))
    assert json.loads((out / "fit.json").read_text())["metric"] == "loss"


def test_an_unfinished_rung_is_a_clear_error(tmp_path):
    r = _write(_run(16, 60, tmp_path), tmp_path, None)
    lines = (tmp_path / "d16" / "metrics.jsonl").read_text().splitlines()[:30]
    from marin.training.metrics import read_metrics

    (tmp_path / "d16" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(LadderFitError, match="metrics stop at step 30 of 60; the run is unfinished"):
        rung_values(r, read_metrics(r.run_path, kind=None), None, (0.1, 1.0))


def test_task_accuracy_is_predicted_through_task_loss(tmp_path):
    """eval.json carries a task whose loss follows a law in compute and accuracy a sigmoid in that
    loss: fit.json predicts the target's accuracy and checks the validation rung's in points."""
    def task_row(run):
        tl = 0.5 + 30.0 * run.flops ** -0.1
        return {"acc": 0.25 + 0.75 / (1 + math.exp(6 * (tl - 1.1))), "gold_bpb": tl, "chance": 0.25, "questions": 64}

    runs = []
    for d, s in [(16, 60), (32, 90), (48, 130), (64, 180), (80, 240), (96, 300)]:
        r = _write(_run(d, s, tmp_path), tmp_path)
        ev = json.loads((tmp_path / f"d{d}-eval" / "eval.json").read_text())
        (tmp_path / f"d{d}-eval" / "eval.json").write_text(json.dumps({**ev, "tasks": {"k40": task_row(r)}}))
        runs.append(r)
    out = tmp_path / "fit"
    out.mkdir()
    ladder_fit_step(LadderFitConfig(rungs=tuple(runs[:-1]), target=_run(96, 300), output_path=str(out),
                                    validation=runs[-1], n_boot=20))
    doc = json.loads((out / "fit.json").read_text())
    t = doc["tasks"]["k40"]
    assert t["task_loss"]["law"] in ("pure", "saturating") and "surface_error" in t["task_loss"]
    assert t["accuracy"]["k"] == pytest.approx(6, rel=0.05) and t["target"]["acc_low"] <= t["target"]["acc"]
    v = doc["validation"]["tasks"]["k40"]
    assert abs(v["acc_error_points"]) < 1.0 and v["acc_inside"]
    assert v["actual_acc"] == pytest.approx(task_row(runs[-1])["acc"])
    vb = doc["validation"]["metrics"]["bpb"]
    assert vb["inside"] and within_band(vb["low"], vb["predicted"], vb["high"])
