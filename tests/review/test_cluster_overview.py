"""The cluster overview of a K40 layout built from raw text, and the domain fit's table: in ``marin
show`` (text and --json) and in the HTML report, checked in headless Chromium as the report is.

The fixture runs the real steps (miniature -> raw text -> domain fit -> assignment -> quality
examples -> classifier -> layout) in this process, each recorded as a succeeded step, so the report
reads what the steps wrote."""

from __future__ import annotations

import json
import re

import pytest
from test_report_browser import CHROMIUM

import marin.review as mr
from experiments.defaults import (
    default_domain_assign,
    default_domain_fit,
    default_k40_layout,
    default_k40_miniature,
    default_quality_classifier,
    default_quality_examples,
    default_raw_text,
)
from marin.data.corpus_steps import CorpusInput
from marin.execution import lease as leases
from marin.execution import plan_steps, resolve_config
from marin.execution import status as st
from marin.execution.experiment_record import write_experiment_record
from marin.execution.options import RunOptions
from marin.execution.status import StepStatus
from marin.execution.tasks import step_info
from marin.review.report import write_report

DOMAINS = ("council", "infra", "law", "news")
LOCAL = CorpusInput(use_ray=False, show_progress=False)


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through Playwright, as the report's browser test opens it (skipped without)."""
    if not CHROMIUM:
        pytest.skip("no chromium binary (Debian: apt-get install chromium; or set MARIN_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install '.[test]')")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def k40_build(tmp_path_factory):
    """Four generated domains, clustered into k=4 and bucketed by a classifier, as recorded steps."""
    prefix = str(tmp_path_factory.mktemp("overview") / "store")
    mini = default_k40_miniature("ov/mini", total_bytes=60_000, domains=DOMAINS)
    raw = default_raw_text("ov/raw", mini, files=2)
    fit = default_domain_fit("ov/fit", raw, k=4, sample_documents=400, input=LOCAL)
    assign = default_domain_assign("ov/assign", raw, fit, input=LOCAL)
    examples = default_quality_examples("ov/examples", per_domain=10, domains=DOMAINS)
    clf = default_quality_classifier("ov/classifier", [examples], [examples])
    layout = default_k40_layout("ov/k40", raw, assign, clf, input=LOCAL)
    plan = plan_steps([layout], prefix)
    for ps in plan.steps:  # each step run as the executor's task runs it: lease, function, SUCCESS
        config = resolve_config(ps, plan)
        lease = leases.try_acquire(ps.output_path, "fixture-host:1:abc", info=step_info(ps, config, "fixture-host"))
        rec = st.read_status(ps.output_path)
        ps.step.fn(config)
        st.write_status(ps.output_path, StepStatus.SUCCESS, lease=lease, previous=rec,
                        started=rec["events"][-1]["time"], consume=leases.lease_path(ps.output_path))
    write_experiment_record(plan, RunOptions(prefix=prefix, script="overview.py"),
                            {s.output_path: "succeeded" for s in plan.steps})
    return prefix, plan.planned(layout).output_path, plan.planned(fit).output_path


def _show(*argv: str, capsys) -> str:
    from marin.cli import main

    assert main(["show", *argv]) == 0
    return capsys.readouterr().out


def test_marin_show_prints_the_cluster_overview_of_the_layout(k40_build, capsys):
    prefix, layout_dir, _ = k40_build
    man = json.load(open(f"{layout_dir}/k40_manifest.json"))
    text = _show("ov/k40", "--prefix", prefix, capsys=capsys)
    assert "cluster overview (k40_manifest.json): 4 domains x 5 quality buckets" in text
    fit_id = man["built_from"]["fit"]["fit_id"]
    assert f"fit {fit_id} (k 4)" in text
    for name, d in man["overview"].items():  # each domain: share, documents, top terms, a sample
        row = next(line for line in text.splitlines() if line.startswith(f"  {name} "))
        assert f"{100 * d['share']:.2f}%" in row and f"{d['documents']:,}" in row
        assert ", ".join(d["top_terms"][:3]) in row
        shares = [round(100 * d["buckets"][b] / d["documents"]) for b in man["buckets"]]
        assert " ".join(str(s) for s in shares) in row  # the quality distribution, % per bucket
        assert f"  {name} [{d['samples'][0]['bucket']}, score" in text
    # largest share first
    order = [line.split()[0] for line in text.splitlines() if re.match(r"  d\d\d ", line)][:4]
    assert order == sorted(man["overview"], key=lambda n: -man["overview"][n]["share"])
    js = json.loads(_show("ov/k40", "--prefix", prefix, "--json", capsys=capsys))
    assert set(js["content"]["cluster_overview"]["domains"]) == set(man["overview"])


def test_marin_show_prints_the_domain_fit(k40_build, capsys):
    prefix, _, fit_dir = k40_build
    man = json.load(open(f"{fit_dir}/domain_fit.json"))
    text = _show("ov/fit", "--prefix", prefix, capsys=capsys)
    assert f"domain fit (domain_fit.json): k 4, fit {man['fit_id']}, embedding hashed-tfidf-svd" in text
    for d in man["domains"]:
        assert any(line.startswith(f"  {d['name']} ") and f"{100 * d['sample_share']:.2f}%" in line
                   for line in text.splitlines())


def test_the_report_shows_the_overview_in_headless_chromium(k40_build, browser, tmp_path):
    prefix, layout_dir, _ = k40_build
    man = json.load(open(f"{layout_dir}/k40_manifest.json"))
    exp = mr.load(prefix=prefix)
    path = write_report(exp, str(tmp_path / "report.html"))
    page = browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)
    attempted, errors = [], []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            attempted.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(f"file://{path}")
    page.wait_for_load_state("load")
    table = page.locator("table.overview")
    assert table.count() == 1
    rows = table.locator("tr")
    assert rows.count() == 1 + len(man["overview"])  # the header and one row per domain
    table.scroll_into_view_if_needed()
    assert table.is_visible()
    # one stacked quality bar per domain with a segment per bucket, and its samples behind a click
    assert page.locator("table.overview svg.quality").count() == len(man["overview"])
    assert page.locator("table.overview svg.quality rect").count() == 5 * len(man["overview"])
    first = rows.nth(1)
    name = first.locator("td").first.inner_text().split()[0]
    sample = man["overview"][name]["samples"][0]["text"]
    details = first.locator("details")
    assert not details.locator("p.sample").first.is_visible()
    details.locator("summary").click()
    shown = details.locator("p.sample").first
    assert shown.is_visible() and " ".join(sample.split())[:40] in shown.inner_text()
    assert ", ".join(man["overview"][name]["top_terms"][:3]) in first.inner_text()
    assert not attempted, attempted
    assert not errors, errors
