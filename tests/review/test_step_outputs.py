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


def _mixture_report_with_coverage() -> dict:
    """A mixture report as the mixture report step writes it for a run of 1.47M tokens: domain c's
    mean is 0.88 epochs while its source c/q5 is read 4.7 times (computed by the data order's own
    coverage functions)."""
    from marin.data.order import WITHOUT_REPLACEMENT_V1, coverage, domain_coverage, format_coverage

    sources = coverage({"c/q1": 1_000_000, "c/q5": 100_000, "web/q1": 2_000_000},
                       {"c/q1": 500_000, "c/q5": 470_000, "web/q1": 500_000}, WITHOUT_REPLACEMENT_V1)
    domains = domain_coverage(sources, WITHOUT_REPLACEMENT_V1)
    return {"stages": [{"start_step": 0, "domain_shares": {"c": 0.66, "web": 0.34}, "sources": []}],
            "coverage": {"order": WITHOUT_REPLACEMENT_V1, "total_tokens": 1_470_000, "sources": sources,
                         "domains": domains, "summary": format_coverage(domains, WITHOUT_REPLACEMENT_V1, "test"),
                         "warnings": [], "legacy": False}}


def test_show_and_the_report_give_a_mixture_s_coverage_and_name_the_source_past_the_limit(small_experiment,
                                                                                         capsys):
    prefix, fx = small_experiment
    step_dir = fx["paths"]["small/corpus"]
    with open(f"{step_dir}/mixture_report.json", "w") as f:
        json.dump(_mixture_report_with_coverage(), f)
    text, content = _shown(step_dir, capsys)
    assert "effective domain shares from step 0" in text
    assert "data coverage (2 domains, 3 sources; 1,470,000 planned tokens, mixture_report.json" in text
    assert "3.2% seen more than once\n" in text  # not "every token at most once": c/q5 is read 4.7 times
    lines = text.splitlines()
    domain_c = next(x.split() for x in lines if x.startswith("  c ") and "epochs" in x)
    assert domain_c[:2] == ["c", "0.88"]  # (500k + 470k) / 1.1M
    source = next(x.split() for x in lines if x.strip().startswith("c/q5"))
    assert source == ["c/q5", "4.70", "100.0%", "100.0%", "470,000", "100,000"]  # read 4.7 times: all repeated
    assert ("  warning: c/q5 is read 4.7 epochs (more than 4: repeated data is worth much less beyond that; its "
            "domain c 0.9 on average)") in lines
    assert [r["source"] for r in content["mixture_coverage"]["sources"]] == ["c/q1", "c/q5", "web/q1"]
    page = render(load_prefix(prefix))
    section = page[page.index("data coverage (order"):]
    assert "warning: c/q5 is read 4.7 epochs" in section and "<td>c/q5<td class=num>4.70" in section
    assert "<td>web<td class=num>0.25<td class=num>25.0%<td class=num>0.0%" in section


def test_show_and_the_report_list_the_corrupt_files_a_token_store_left_out(small_experiment, capsys):
    prefix, fx = small_experiment
    step_dir = fx["paths"]["small/tokenized"]
    with open(f"{step_dir}/manifest.json") as f:
        manifest = json.load(f)
    manifest["skipped_files"] = [{"source": "web/q1", "input_file": "/data/web/q1/part-7.jsonl.gz",
                                  "reason": "corrupt input web/q1/part-7.jsonl.gz: not a gzipped file"}]
    manifest["totals"]["skipped_files"] = 1
    with open(f"{step_dir}/manifest.json", "w") as f:
        json.dump(manifest, f)
    text, content = _shown(step_dir, capsys)
    assert "skipped documents: invalid_utf8 2, empty 1 (30 bytes); corrupt files skipped: 1" in text
    assert ("  corrupt file skipped: /data/web/q1/part-7.jsonl.gz (web/q1): corrupt input web/q1/part-7.jsonl.gz: "
            "not a gzipped file") in text.splitlines()
    assert content["token_store"]["skipped_files"] == manifest["skipped_files"]
    page = render(load_prefix(prefix))
    assert "corrupt files skipped: 1" in page and "<td>/data/web/q1/part-7.jsonl.gz<td>web/q1" in page
