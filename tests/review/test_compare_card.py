"""marin compare, the report's comparison section, and the experiment card with its outcome."""

from __future__ import annotations

import json
import os

from review_fixtures import build_health, build_small

from marin.cli import main
from marin.execution.experiment_record import write_experiment_record
from marin.execution.options import RunOptions

CARD = {"hypothesis": "Loss falls below 2.5 by step 60.", "goal": "macro bpb under 1.4",
        "risks": "grad norm spikes", "contingency": "lower the LR and rerun"}


def test_compare_prints_differing_versioned_fields_and_last_values(capsys, tmp_path):
    prefix = str(tmp_path / "store")
    build_small(prefix)
    rc = main(["compare", "small/train", "small/live-train", "--prefix", prefix])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "train_steps" in out and "60" in out and "100" in out and "peak_lr" in out
    assert "last loss" in out and "last grad_norm" in out
    assert "data" not in [line.split()[0] for line in out.splitlines()[3:] if line.split()]  # same input: not shown
    rc = main(["compare", "small/train", "small/live-train", "--prefix", prefix, "--json",
               "-o", str(tmp_path / "cmp.html")])
    res = json.loads(capsys.readouterr()[0])
    assert rc == 0 and len(res["steps"]) == 2
    curve = res["curves"][res["steps"][0]]["loss"]
    assert curve["step"][:2] == [1, 2] and curve["tokens"][:2] == [4096, 8192] and len(curve["flops"]) == 60
    html = open(tmp_path / "cmp.html").read()
    # 4 curves x (step, tokens); these fixture steps name no model, so there is no FLOP axis to draw
    assert html.count("<svg") == 8 and "loss vs tokens" in html


def test_compare_bad_input_is_one_line(capsys, tmp_path):
    prefix = str(tmp_path / "store")
    build_small(prefix)
    assert main(["compare", "small/train", "--prefix", prefix]) == 2
    assert "at least two" in capsys.readouterr()[1]
    assert main(["compare", "small/train", "small/nope", "--prefix", prefix]) == 2
    err = capsys.readouterr()[1]
    assert "no step named 'small/nope'" in err and err.count("\n") == 1


def test_report_shows_the_card_with_the_outcome_and_overlays_training_steps(tmp_path):
    import marin.review as mr
    from marin.review.report import render

    prefix = str(tmp_path / "store")
    fx = build_small(prefix)
    plan = fx["plan"]
    with open(os.path.join(fx["paths"]["small/eval"], "harness.json"), "w") as f:
        json.dump({"step": 60, "summary": {"k40_mc": {"acc": 0.5, "acc_norm": 0.625}}}, f)
    write_experiment_record(plan, RunOptions(prefix=prefix, script="small.py", description="a small review fixture",
                                             card=CARD), {})
    exp = mr.load_prefix(prefix, "small")
    assert exp.card == CARD
    page = render(exp)
    card = page[page.index('id="card"'):page.index('id="dagwrap"') if 'id="dagwrap"' in page else None]
    assert "Loss falls below 2.5 by step 60." in card and "lower the LR and rerun" in card
    assert "small/eval: eval" in card and "macro bpb 1.315" in card
    assert "small/ladder-fit: health" in card and "needs a look" in card
    assert "small/eval: harness" in card and "k40_mc acc 0.5" in card
    assert "lm-evaluation-harness: " in page and "acc_norm" in page
    assert 'id="comparison"' in page and "loss vs tokens" in page


def test_executor_main_records_the_card_and_the_tutorial_fills_it(tmp_path):
    import marin.review as mr
    from marin.execution import ExecutorMainConfig, ExecutorStep, executor_main, this_output_path, versioned

    def write(config):
        with open(os.path.join(config["out"], "x.txt"), "w") as f:
            f.write("1")

    step = ExecutorStep("card/one", write, {"out": this_output_path(), "n": versioned(1)})
    plain = executor_main(ExecutorMainConfig(prefix=str(tmp_path / "a")), [step])
    carded = executor_main(ExecutorMainConfig(prefix=str(tmp_path / "b")), [step], **CARD)
    assert json.load(open(carded.record_path))["card"] == CARD
    assert json.load(open(plain.record_path))["card"] is None
    # the card is not versioned: the same step, the same hash
    assert os.path.basename(plain.plan.steps[0].output_path) == os.path.basename(carded.plan.steps[0].output_path)
    tutorial = mr.load_file(os.path.join(os.path.dirname(__file__), "..", "..", "experiments", "tutorial.py"),
                            str(tmp_path / "c"))
    assert "499,455" in tutorial.card["hypothesis"] and tutorial.card["contingency"]


def test_compare_shows_plain_values_and_refuses_a_step_that_does_not_train(capsys, tmp_path):
    prefix = str(tmp_path / "store")
    build_small(prefix)
    assert main(["compare", "small/train", "small/live-train", "--prefix", prefix]) == 0
    out = capsys.readouterr()[0]
    assert '{"float"' not in out and '{"dict"' not in out and '{"tuple"' not in out
    assert next(line.split() for line in out.splitlines() if line.startswith("peak_lr")) == ["peak_lr", "0.01", "0.02"]
    assert main(["compare", "small/train", "small/eval", "--prefix", prefix]) == 2
    err = capsys.readouterr()[1]
    assert err.startswith("marin: error: [2] small/eval-") and err.count("\n") == 1
    assert err.rstrip().endswith(": not a training run (no metrics.jsonl, no train_steps in its config); compare "
                                 "training runs with training runs")


def test_compare_refuses_a_health_step_beside_its_run_in_one_line(capsys, tmp_path):
    """A health report's config names the run's horizon (``total_steps``) but it trains nothing."""
    prefix = str(tmp_path / "store")
    fx = build_small(prefix)
    health_dir = build_health(prefix, fx["paths"]["small/train"], 60)
    assert main(["compare", "small/train", health_dir, "--prefix", prefix]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("marin: error: [2] small/health-") and "health_report_step" in err
    assert err.rstrip().endswith(": not a training run (no metrics.jsonl, no train_steps in its config); compare "
                                 "training runs with training runs")
