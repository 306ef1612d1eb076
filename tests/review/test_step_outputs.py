"""The table of step outputs: `Step`, `marin show` (text and --json) and the HTML report read every
output through it, and an output added to the table is shown everywhere with nothing else changed."""

from __future__ import annotations

import json

from marin.cli import main
from marin.review import load_prefix
from marin.review import outputs as step_outputs
from marin.review.outputs import OUTPUTS, StepOutput
from marin.review.report import render
from marin.review.sections import kv


def _shown(step_dir: str, capsys) -> tuple[str, dict]:
    assert main(["show", step_dir]) == 0
    text = capsys.readouterr().out
    assert main(["show", step_dir, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)["content"]


def test_every_output_a_step_has_is_read_by_step_show_and_the_report(small_experiment, capsys):
    prefix, _ = small_experiment
    exp = load_prefix(prefix)
    report = render(exp)
    seen = set()
    for s in exp.steps:
        for o in OUTPUTS:
            raw = s.read_json(o.file)
            if raw is None:
                continue
            seen.add(o.file)
            assert s.output(o.file) == raw == s.output(o.key) and s.outputs()[o.file] == raw
            assert f"<h3>{o.title}</h3>" in report
            text, content = _shown(s.output_path, capsys)
            assert content[o.key] == o.keep(raw)
            assert f"({o.file})" in text, text
    assert {"health.json", "eval.json", "fit.json", "manifest.json"} <= seen  # what the fixture writes


def test_an_output_added_to_the_table_is_shown_everywhere(small_experiment, capsys, monkeypatch):
    prefix, fx = small_experiment
    step_dir = fx["paths"]["small/eval"]
    with open(f"{step_dir}/calibration.json", "w") as f:
        json.dump({"ece": 0.031, "bins": 15, "per_bin": [0.1, 0.2]}, f)
    added = StepOutput("calibration.json", "calibration", "calibration", html=kv, result=True)
    monkeypatch.setattr(step_outputs, "OUTPUTS", (*OUTPUTS, added))

    exp = load_prefix(prefix)
    step = exp.step("small/eval")
    assert step.output("calibration") == {"ece": 0.031, "bins": 15, "per_bin": [0.1, 0.2]}
    report = render(exp)
    assert "<h3>calibration</h3>" in report and '<h3>calibration: <a href="#' in report  # section and results
    text, content = _shown(step_dir, capsys)
    assert content["calibration"]["ece"] == 0.031
    assert "calibration (calibration.json): ece 0.031, bins 15" in text


def test_a_file_that_is_not_the_output_it_is_named_after_is_not_shown(small_experiment, capsys):
    prefix, fx = small_experiment
    step_dir = fx["paths"]["small/eval"]
    with open(f"{step_dir}/manifest.json", "w") as f:
        json.dump({"written_by": "another tool"}, f)  # no totals: not a token store's manifest
    step = load_prefix(prefix).step("small/eval")
    assert step.manifest() is None and "manifest.json" not in step.outputs()
    _, content = _shown(step_dir, capsys)
    assert "token_store" not in content
