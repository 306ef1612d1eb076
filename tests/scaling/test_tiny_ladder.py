"""experiments/tiny_ladder.py end to end on local Ray: rungs train, the fit predicts, the validation
rung is checked. The reduced ladder runs by default; the full one (the documented run) is slow."""

from __future__ import annotations

import json
import os

import pytest

from marin.execution import ExecutorMainConfig, executor_main


def _run(size: str, prefix: str):
    from experiments.tiny_ladder import tiny_ladder

    steps = tiny_ladder(size)
    # at most as many steps at once as the test cluster has CPUs (4): pools never wait for one
    result = executor_main(ExecutorMainConfig(prefix=prefix, progress=False, max_concurrent=4),
                           steps=[steps["mixture_report"], steps["fit"], steps["check"]])
    assert set(result.outcome.values()) == {"succeeded"}, result.errors
    return steps, result


def _check_outputs(steps, result):
    fit_dir = result.plan.planned(steps["fit"]).output_path
    check_dir = result.plan.planned(steps["check"]).output_path
    with open(os.path.join(fit_dir, "fit.json")) as f:
        fit = json.load(f)
    with open(os.path.join(check_dir, "fit.json")) as f:
        check = json.load(f)
    assert "validation_rel_error" not in fit and fit["target"]["name"] == steps["validation"]
    assert set(fit["predictions"]) == {"0.03", "0.1", "0.3", "0.5", "1"}
    for p in fit["predictions"].values():
        assert p["low"] <= p[p["metric"]] <= p["high"] and p["loss_low"] <= p["loss"] <= p["loss_high"]
    assert fit["params"]["loss"]["form"] in ("saturating", "pure") and "r2" in fit["params"]["loss"]
    assert isinstance(fit["loo_rel_error"], float)
    assert len(fit["grad_norm"]["per_rung"]) == len(steps["rungs"]) - 1  # the validation rung is never fitted
    for png in fit["plots"]:
        with open(os.path.join(fit_dir, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # the check fits the same rungs (same prediction) and compares the validation rung with it
    assert check["params"]["loss"] == fit["params"]["loss"]
    v = check["validation"]["metrics"][check["validation"]["metric"]]
    assert check["validation_rel_error"] == pytest.approx((v["predicted"] - v["actual"]) / v["actual"])
    with open(os.path.join(result.plan.planned(steps["mixture_report"]).output_path, "mixture_report.json")) as f:
        report = json.load(f)
    # the largest run (the validation rung) reads every source less than once over both mixture
    # stages (uniform for the first 30%, quality-weighted after): no data repeats
    total_steps, stages = report["total_steps"], report["stages"]
    ends = [st["start_step"] for st in stages[1:]] + [total_steps]
    epochs: dict[str, float] = {}
    for st, end in zip(stages, ends):
        for s in st["sources"]:
            epochs[s["source"]] = (
                epochs.get(s["source"], 0.0) + s.get("epochs", 0.0) * (end - st["start_step"]) / total_steps
            )
    assert stages[1]["start_fraction"] == 0.3 and 0 < max(epochs.values()) < 1.0, max(epochs.values())
    return fit, check


@pytest.mark.slow  # 85 s end to end; the fits' cores: tests/scaling/test_ladder_fit.py, test_fit.py
def test_reduced_tiny_ladder(ray_local, tmp_path):
    steps, result = _run("reduced", str(tmp_path))
    _check_outputs(steps, result)
    again = executor_main(ExecutorMainConfig(prefix=str(tmp_path), progress=False),
                          steps=[steps["mixture_report"], steps["fit"], steps["check"]])
    assert set(again.outcome.values()) == {"cached"}


@pytest.mark.slow
# 526 s alone on an idle 2-core machine, 1,130 s at a load average of 4 to 17 from other jobs: its 4
# rungs and validation rung share the cores with the other pytest worker in `make test-slow`, past
# the default 600 s there, inside 3x its idle time (a load of 15 to 35 took it past 1,800 s). It is
# the documented experiment itself (docs/scaling.md's numbers): fewer rungs or steps would check
# another ladder than the one whose prediction the docs report.
@pytest.mark.timeout(1800)
def test_full_tiny_ladder_predicts_its_validation_rung(ray_local, tmp_path):
    steps, result = _run("full", str(tmp_path))
    fit, check = _check_outputs(steps, result)
    assert fit["metric"] == "bpb" and fit["params"]["bpb"]["r2"] > 0.95
    # With four rungs select_law picks the pure law: +1.5% measured, inside its band (docs/scaling.md,
    # "What the tiny ladder shows"; the saturating law had +6.4%). Off by 10% means something broke.
    assert fit["params"]["bpb"]["form"] == "pure" and check["validation"]["metrics"]["bpb"]["inside"]
    assert abs(check["validation_rel_error"]) < 0.10, check["validation"]
