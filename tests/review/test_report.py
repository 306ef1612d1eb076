"""The report and the Python client, checked on step directories written by the executor's own
functions (see conftest): structure of the HTML, every section present, secrets masked, no
network references; downsampling that keeps extremes; grouping of a large DAG."""

from __future__ import annotations

import math
import random
import re
from html.parser import HTMLParser

import pytest
from review_fixtures import build_fanout

import marin.review as mr
from marin.execution import status as st
from marin.review import dag as dagmod
from marin.review.plots import downsample_minmax
from marin.review.report import render, write_report


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.nodes: list[str] = []
        self.hrefs: list[str] = []
        self.srcs: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if "id" in a:
            self.ids.append(a["id"])
        if tag == "a" and a.get("class") == "node":
            self.nodes.append(a["href"])
        if "href" in a:
            self.hrefs.append(a["href"])
        if "src" in a:
            self.srcs.append(a["src"])


def test_report_structure_of_a_small_experiment(small_experiment, tmp_path):
    prefix, built = small_experiment
    exp = mr.load(prefix=prefix)
    out = write_report(exp, str(tmp_path / "r.html"))
    text = open(out).read()
    doc = _Collect()
    doc.feed(text)
    assert len(doc.nodes) == len(exp.steps) == 9  # one DAG node per step
    assert len(set(doc.ids)) == len(doc.ids)  # anchors are unique
    for href in doc.hrefs:  # every link is to a section of this file: nothing to fetch
        assert href.startswith("#") and href[1:] in doc.ids, href
    assert not doc.srcs or all(s.startswith("data:") for s in doc.srcs)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", text)
    assert "<link" not in text and "@import" not in text
    # statuses as the files say
    states = {s.name: s.state.category for s in exp.steps}
    assert states == {"small/corpus": "reused", "small/tokenized": "succeeded", "small/train": "succeeded",
                      "small/eval": "succeeded", "small/ladder-fit": "succeeded", "small/broken": "failed",
                      "small/live-train": "running", "small/stopped": "interrupted", "small/never": "not run"}
    # sections: failed step's error and traceback, eval table, ladder fit, health checklist, skipped docs
    assert "ValueError: shard 3 is corrupt" in text and "Traceback (most recent call last)" in text
    assert "macro" in text and "1.315" in text and "hero 535B-A23B" in text and "0.012" in text
    assert "peak 4.5 above 4" in text and "needs a look" in text
    assert "invalid_utf8 2" in text
    # training plots with the transport and sequence-length changes marked, eval curves
    assert text.count('class="plot"') >= 8 + 3
    assert "task accuracy (in-training eval)" in text  # eval/task/k40/acc of the training step's eval records
    assert "transport=dropless" in text and "L=128" in text
    # the per-phase table: transport in use and its drops (fixed: 2% send, 3% recv before the switch)
    assert "<th>drops (send)<th>drops (recv)" in text and "<td>fixed<td" in text and "3.000%" in text
    assert "60 of 60 (100.0% of horizon)" in text and "40 of 100 (40.0% of horizon)" in text
    # versioned fields marked, secrets masked
    assert '<tr class=v><td class=mono>train_steps' in text and "<tr><td class=mono>log_every" in text
    assert "sk-verysecretvalue" not in text and "***" in text
    assert "rerun the experiment" in text  # the interrupted step says what to do


def test_client_reads_steps_metrics_files_and_results(small_experiment):
    prefix, built = small_experiment
    exp = mr.load(prefix=prefix)
    train = exp.step("small/train")
    assert train.status == "SUCCESS" and train.horizon == 60 and train.duration_s is not None
    table = train.metrics()
    assert table.num_rows == 60 and "grad_norm" in table.column_names
    assert train.metrics(kind="eval").num_rows == 3
    assert dict(train.files())["metrics.jsonl"] > 0
    assert exp.step("small/eval").eval_results()["macro_bpb"] == 1.315
    assert exp.health()["ok"] is False
    assert exp.eval_results()["small/eval"]["sets"]["web"]["bpb"] == 1.41
    assert exp.step("small/stopped").state.label.startswith("INTERRUPTED")
    assert exp.step("small/train").config["wandb_api_key"] == "***"
    with pytest.raises(KeyError, match="no step 'nope'"):
        exp.step("nope")


def test_unknown_status_values_are_shown_as_written(small_experiment):
    prefix, built = small_experiment
    import json

    step_dir = built["paths"]["small/stopped"]
    rec = st.read_status(step_dir)  # RUNNING, recorded by its lease only
    rec["status"] = "INTERRUPTED"
    json.dump(rec, open(f"{step_dir}/{st.STATUS_FILE}", "w"))
    step = mr.load(prefix=prefix).step("small/stopped")
    assert step.status == "INTERRUPTED" and step.state.category == "interrupted"
    assert "INTERRUPTED" in render(mr.load(prefix=prefix))


def test_large_dag_is_grouped_by_name_prefix(tmp_path):
    prefix = str(tmp_path / "fan")
    build_fanout(prefix, 400)  # past the 150-node limit (benchmarks/report_bench.py times 1,000)
    exp = mr.load(prefix=prefix)
    assert len(exp.steps) == 408
    text = render(exp)
    doc = _Collect()
    doc.feed(text)
    assert len(doc.nodes) == 9  # eight fan/g<k>/* groups and summary/*, not 408 nodes
    assert "#group-fan_g0__" in doc.nodes
    assert "fan/g0/* (50)" in text
    assert len(text) < 5_000_000


def test_downsample_keeps_every_bucket_extreme():
    rng = random.Random(0)
    ys = [rng.gauss(0, 1) for _ in range(100_003)]
    ys[77_777] = 50.0  # a one-step spike
    ys[12_345] = float("nan")
    xs = list(range(len(ys)))
    dx, dy = downsample_minmax(xs, ys, 500)
    assert len(dx) <= 1000 and dx == sorted(dx)
    assert max(dy) == 50.0 and 77_777 in dx
    finite = [(x, y) for x, y in zip(xs, ys) if not math.isnan(y)]
    assert min(dy) == min(y for _, y in finite)
    # slow obvious reference: per bucket, the min and max points
    n = len(finite)
    for b in (0, 137, 499):
        chunk = finite[b * n // 500:(b + 1) * n // 500]
        lo, hi = min(chunk, key=lambda p: p[1]), max(chunk, key=lambda p: p[1])
        assert lo[0] in dx and hi[0] in dx
    assert downsample_minmax([1, 2, 3], [3.0, 1.0, 2.0], 10) == ([1, 2, 3], [3.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="buckets must be positive"):
        downsample_minmax([1], [1.0], 0)


def test_dag_layers_follow_dependencies():
    nodes = [dagmod.Node("c", "c", ["b"], {"succeeded": 1}), dagmod.Node("a", "a", [], {"succeeded": 1}),
             dagmod.Node("b", "b", ["a"], {"failed": 1}), dagmod.Node("d", "d", ["a", "c"], {"not run": 1})]
    assert dagmod.layers(nodes) == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert dagmod.group_key("tokenized/harrier_k40/web_q1", 1) == "tokenized/harrier_k40/*"
    assert dagmod.group_key("tokenized/harrier_k40/web_q1", 2) == "tokenized/*"
    assert dagmod.group_key("solo", 1) == "solo"


def test_downsample_numpy_path_matches_the_plain_one():
    from marin.review.plots import _downsample_numpy

    rng = random.Random(1)
    ys = [rng.random() for _ in range(5_000)] + [float("inf"), None] + [rng.random() for _ in range(3_001)]
    xs = list(range(len(ys)))
    plain = downsample_minmax(xs, ys, 100_000 // 20 + 1)  # below the numpy threshold: the plain loop
    assert plain[0] == [x for x, y in zip(xs, ys) if isinstance(y, float) and y != float("inf")]
    fast = _downsample_numpy(xs, ys, 50)
    finite = [(x, y) for x, y in zip(xs, ys) if isinstance(y, float) and y != float("inf")]
    n = len(finite)
    expected = []
    for b in range(50):  # the plain definition, bucket by bucket
        chunk = list(range(b * n // 50, (b + 1) * n // 50))
        lo = min(chunk, key=lambda i: (finite[i][1], i))
        hi = max(chunk, key=lambda i: (finite[i][1], -i))
        expected.extend(finite[i][0] for i in sorted({lo, hi}))
    assert fast[0] == expected


def test_default_report_step_depends_on_its_steps_and_writes_the_report(small_experiment, tmp_path):
    from experiments.defaults import default_report
    from marin.execution import plan_steps, resolve_config
    from marin.review.report import report_step

    prefix, built = small_experiment
    plan = built["plan"]
    evals = next(ps.step for ps in plan.steps if ps.name == "small/eval")
    broken = next(ps.step for ps in plan.steps if ps.name == "small/broken")
    step = default_report("small/report", [evals, broken], description="fixture")
    rplan = plan_steps([step], prefix)
    ps = rplan.planned(step)
    assert {d.name for d in ps.dependencies} == {"small/eval", "small/broken"}
    config = resolve_config(ps, rplan)
    path = report_step(config)
    assert path == f"{ps.output_path}/report.html"
    text = open(path).read()
    for name in ("small/corpus", "small/tokenized", "small/train", "small/eval", "small/broken"):
        assert f">{name}</a>" in text, name  # the reported steps and everything upstream of them
    assert "small/ladder-fit</a>" not in text  # not upstream of either
