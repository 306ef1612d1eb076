"""Evaluating a training run: eval sets from token stores, in-training eval records, the standalone
eval of committed checkpoints, and the readers of metrics.jsonl."""

from __future__ import annotations

import json
import os

import pytest

from marin.evaluation.sets import (
    EvalSet,
    EvalSetError,
    load_eval_set,
    mixture_validation_sets,
)
from marin.evaluation.suite import TASK_KEY
from marin.inference.evaluate import EvalConfig, run_eval
from marin.training.metrics import phase_summary, read_metrics


def test_named_set_bytes_are_the_input_text_bytes(eval_store):
    sets = load_eval_set(EvalSet("all", eval_store))
    with open(os.path.join(eval_store, "manifest.json")) as f:
        manifest = json.load(f)
    assert list(sets) == ["all"]
    assert int(sets["all"].bytes.sum()) == manifest["totals"]["bytes"]
    assert len(sets["all"].tokens) == manifest["totals"]["documents"]
    # every token of every document, without the closing EOS
    assert sets["all"].num_tokens == manifest["totals"]["tokens"] - manifest["totals"]["documents"]


def test_held_out_sets_are_the_mixtures_validation_documents(eval_store):
    from marin.data.loader import MixtureLoader
    from marin.data.mixture import MixtureConfig

    mix = MixtureConfig(stores=(eval_store,), validation_fraction=0.05)
    (es,) = mixture_validation_sets(mix)
    sets = load_eval_set(es)
    assert sorted(sets) == ["val/council", "val/infra", "val/science", "val/web_code"]
    loader = MixtureLoader(mix)
    for domain in ("council", "science"):
        # the loader's held-out tokens of a domain = documents + their EOS tokens
        d = sets[f"val/{domain}"]
        assert d.num_tokens + len(d.tokens) == loader.validation_tokens(domain)


def test_suite_names_are_unique_except_a_domain_held_out_in_several_stores(eval_store):
    from marin.evaluation.sets import load_eval_sets

    one = load_eval_sets([EvalSet("val", eval_store, held_out=True)])
    two = load_eval_sets([EvalSet("val", eval_store, held_out=True), EvalSet("val", eval_store, held_out=True)])
    assert len(two["val/council"].tokens) == 2 * len(one["val/council"].tokens)
    with pytest.raises(EvalSetError, match="two eval sets are named 'x'"):
        load_eval_sets([EvalSet("x", eval_store), EvalSet("x", eval_store)])


def test_bad_sets_fail_in_one_line(eval_store, tmp_path, eval_tokenizer):
    with pytest.raises(EvalSetError, match="no token store") as e:
        load_eval_set(EvalSet("x", str(tmp_path / "missing")))
    assert "\n" not in str(e.value)
    with pytest.raises(EvalSetError, match="tokenizer mismatch"):
        load_eval_set(EvalSet("x", eval_store), tokenizer="0" * 64)
    with pytest.raises(EvalSetError, match="has no documents held out"):
        load_eval_set(EvalSet("x", eval_store, held_out=True, validation_fraction=0.0))


def test_only_committed_checkpoints_are_evaluated(tmp_path):
    import numpy as np

    from marin.training.checkpoint import select_steps, write_checkpoint

    run = str(tmp_path)
    write_checkpoint(f"{run}/checkpoints/step-00000010", {"x": np.zeros(2)}, {}, step=10)
    write_checkpoint(f"{run}/checkpoints/step-00000020", {"x": np.zeros(2)}, {}, step=20)
    os.remove(f"{run}/checkpoints/step-00000020/COMMIT")  # a save that died before its commit marker
    assert select_steps(run, "latest") == [10] and select_steps(run, "all") == [10]
    with pytest.raises(FileNotFoundError, match="no committed checkpoint at step 20"):
        select_steps(run, 20)


def test_in_training_eval_equals_standalone_eval_of_the_checkpoint(trained_run):
    TRAIN_STEPS = trained_run.train_steps
    records = read_metrics(trained_run.output_path, kind="eval")
    assert [r["step"] for r in records] == [15, 30, TRAIN_STEPS]  # the last step is always evaluated
    assert all(r["kind"] == "eval" and "eval/val/council/bpb" in r for r in records)
    # every reader of training records sees training steps only
    train = read_metrics(trained_run.output_path)
    assert [r["step"] for r in train] == list(range(1, TRAIN_STEPS + 1))
    assert phase_summary(train)[0]["last_step"] == TRAIN_STEPS

    # the eval step on the same checkpoints, sets and task file as the run's in-training eval
    result = run_eval(EvalConfig(trained_run.output_path, "", held_out=True, checkpoint="all",
                                 tasks=dict(trained_run.evaluation.tasks)), use_ray=False)
    assert [c["step"] for c in result["checkpoints"]] == [15, 30, TRAIN_STEPS] and result["step"] == TRAIN_STEPS
    for rec, ck in zip(records, result["checkpoints"]):
        assert ck["macro_bpb"] == pytest.approx(rec["eval/macro_bpb"], rel=1e-5)
        assert ck["micro_bpb"] == pytest.approx(rec["eval/micro_bpb"], rel=1e-5)
        for name, m in ck["sets"].items():
            assert m["bpb"] == pytest.approx(rec[f"eval/{name}/bpb"], rel=1e-5)
        task = ck["tasks"]["k40_domains"]
        assert task["questions"] == 16
        assert rec[TASK_KEY.format(name="k40_domains", metric="acc")] == task["acc"]
        assert rec[TASK_KEY.format(name="k40_domains", metric="acc_norm")] == task["acc_norm"]
        assert rec[TASK_KEY.format(name="k40_domains", metric="gold_bpb")] == pytest.approx(task["gold_bpb"], rel=1e-5)
    first, last = result["checkpoints"][0], result["checkpoints"][-1]
    assert last["macro_bpb"] < first["macro_bpb"]
    assert last["tasks"]["k40_domains"]["gold_bpb"] < first["tasks"]["k40_domains"]["gold_bpb"]
    assert set(last["sets"]["val/council"]) == {"documents", "tokens", "bytes", "loss", "perplexity", "bpb"}


def test_health_reads_training_records_only(trained_run):
    from marin.monitoring.health import health

    report = health(read_metrics(trained_run.output_path), trained_run.train_steps)
    assert report["summary"]["last_step"] == trained_run.train_steps
    assert {c["name"]: c["ok"] for c in report["checks"]}["finite"] is True
    # the file holds both kinds; a resumed writer keeps both (kind=None reads everything)
    assert {r.get("kind", "train") for r in read_metrics(trained_run.output_path, kind=None)} == {"train", "eval"}


def test_health_report_shows_the_runs_measured_task_accuracy_next_to_the_prediction(trained_run, tmp_path):
    from marin.monitoring.health import HealthReportConfig, format_prediction_report, health_report_step

    steps = trained_run.train_steps
    fit = {"target": {"name": "tiny", "train_steps": steps}, "fractions": [1.0],
           "predictions": {"1": {"loss": 5.0, "loss_low": 4.0, "loss_high": 6.0, "metric": "loss", "low": 4.0,
                                 "high": 6.0}},
           "tasks": {"k40_domains": {"target": {"acc": 0.6, "acc_low": 0.5, "acc_high": 0.7, "task_loss": 1.5}}}}
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    report = health_report_step(HealthReportConfig(trained_run.output_path, str(tmp_path), fit_path=str(tmp_path)))
    (row,) = report["prediction"]["tasks"]
    last = read_metrics(trained_run.output_path, kind="eval")[-1]
    assert row["measured_step"] == steps and row["at_fraction"] == 1.0
    assert row["measured_acc"] == last[TASK_KEY.format(name="k40_domains", metric="acc")]
    assert row["measured_task_loss"] == last[TASK_KEY.format(name="k40_domains", metric="gold_bpb")]
    text = format_prediction_report(report["prediction"])
    assert (f"task k40_domains: accuracy predicted 0.600 [0.500, 0.700] at the end of the run; measured "
            f"{row['measured_acc']:.3f} at step {steps} (100% of the run)") in text


def test_default_eval_step_writes_eval_json_and_is_cached(ray_local, trained_run, eval_corpus, eval_tokenizer,
                                                          tmp_path):
    """default_eval as an executor step on local Ray: a named suite tokenized by its own tokenize step
    plus the run's held-out split, every checkpoint, on the run's pool; a rerun is cached."""
    import dataclasses
    import shutil

    from experiments.defaults import default_eval, default_eval_suite
    from marin.execution import (
        ExecutorMainConfig,
        ExecutorStep,
        executor_main,
        this_output_path,
    )
    from marin.training.steps import train as train_fn

    # the training step pinned to a copy of the finished run (the executor records its status there; the
    # shared run stays as built): it resumes at its last step (no work)
    prefix, run_dir = str(tmp_path), str(tmp_path / "run")
    shutil.copytree(trained_run.output_path, run_dir)
    train = ExecutorStep(
        name="run",
        fn=train_fn,
        config=dataclasses.replace(trained_run, output_path=this_output_path()),
        override_output_path=run_dir,
        resources={"num_cpus": 0},
    )
    suite = default_eval_suite({"council-q5": f"{eval_corpus}/council/q5/*"}, eval_tokenizer)
    task = os.path.join(prefix, "toy_task.jsonl")
    with open(task, "w") as f:
        f.write(json.dumps({"context": "Council note 1.", "choices": [" Vote", " zzqx"], "gold": 0}) + "\n")
    step = default_eval("eval/run", train, suite, checkpoint="all", held_out=True, tasks={"toy": task})
    cfg = ExecutorMainConfig(prefix=prefix, progress=False)
    result = executor_main(cfg, steps=[step])
    assert result.outcome[result.plan.planned(step).output_path] == "succeeded", result.errors
    with open(os.path.join(result.plan.planned(step).output_path, "eval.json")) as f:
        ev = json.load(f)
    assert ev["step"] == trained_run.train_steps and [c["step"] for c in ev["checkpoints"]] == [15, 30, 40]
    assert "council-q5" in ev["sets"] and "val/council" in ev["sets"]
    assert ev["tasks"]["toy"]["questions"] == 1 and ev["checkpoints"][0]["tasks"]["toy"]["chance"] == 0.5
    assert ev["macro_bpb"] == pytest.approx(sum(s["bpb"] for s in ev["sets"].values()) / len(ev["sets"]))
    again = executor_main(cfg, steps=[step])
    assert again.outcome[again.plan.planned(step).output_path] == "cached"
