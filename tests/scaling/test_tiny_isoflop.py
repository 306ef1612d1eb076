"""experiments/tiny_isoflop.py end to end on local Ray (slow: about the documented run time): the
grid trains, the fit finds each budget's optimum, the compute-optimal validation run is built from the
fit, trained and checked. The fast tests of the same code are test_isoflop.py on synthetic runs."""

from __future__ import annotations

import json
import os

import pytest

from marin.execution import ExecutorMainConfig, executor_main


def test_the_grid_plans_with_its_task_as_a_dependency(tmp_path):
    """Declaration and planning only: 3 budgets x 4-5 sizes, each eval step reads the task step."""
    from experiments.tiny_isoflop import GRID, tiny_isoflop

    steps = tiny_isoflop()
    assert len(steps["grid"]) == sum(len(w) for w in GRID.values()) >= 12 and all(len(w) >= 4 for w in GRID.values())
    result = executor_main(ExecutorMainConfig(prefix=str(tmp_path), dry_run=True, progress=False), steps=[steps["fit"]])
    task = result.plan.planned(steps["task"])
    for _, _, ev in steps["grid"]:
        assert task in result.plan.planned(ev).dependencies


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 15 min measured on 2 loaded cores (docs/performance.md); the default is 600 s
def test_tiny_isoflop_builds_and_checks_its_validation_run(ray_local, tmp_path):
    from experiments.tiny_isoflop import GRID, VALIDATION_BUDGET, tiny_isoflop, tiny_isoflop_validation

    config = ExecutorMainConfig(prefix=str(tmp_path), progress=False, max_concurrent=4)
    steps = tiny_isoflop()
    first = executor_main(config, steps=[steps["fit"]])
    assert set(first.outcome.values()) == {"succeeded"}, first.errors
    with open(os.path.join(first.plan.planned(steps["fit"]).output_path, "isoflop.json")) as f:
        doc = json.load(f)
    assert doc["metric"] == "bpb" and len(doc["metrics"]["bpb"]["parabolas"]) == len(GRID)
    assert doc["next"]["config"]["flops"] == pytest.approx(VALIDATION_BUDGET, rel=0.02)
    val = tiny_isoflop_validation(steps, doc)
    assert val["optimal"].rung.model.d_model == doc["next"]["config"]["width"]
    second = executor_main(config, steps=[steps["fit"], val["check"]])
    assert set(second.outcome.values()) <= {"succeeded", "cached"}, second.errors
    with open(os.path.join(second.plan.planned(val["check"]).output_path, "isoflop.json")) as f:
        check = json.load(f)
    v = check["validation"]["metrics"]["bpb"]
    assert v["low"] < v["predicted"] < v["high"] and "k40_domains" in check["validation"]["tasks"]
    # the goal is 2% and inside the band; the measured result is in docs/scaling.md. 10% means something broke.
    assert abs(check["validation_rel_error"]) < 0.10, check["validation"]
