"""The README's main job end to end (experiments/quickstart.py): miniature K40 -> tokenizer, dedup,
decontamination -> tokenize -> mixture -> a tiny MoE training run on local Ray with EP over fake CPU devices -> health.
Loss falls, the transport hot-switches, the sequence length extends, metrics.jsonl and W&B files
are written, and the health report is clear."""

import glob
import json
import os

import pytest

from marin.execution import ExecutorMainConfig, executor_main
from marin.training.metrics import read_metrics


@pytest.mark.slow  # the README's quickstart, 10 steps and 60 training steps on local Ray; its cores run in the
# default set: test_trainer.py (learning, W&B, sequence-length phases, the transport switch), the eval step
# (tests/evaluation/test_eval_step.py), health (tests/monitoring), caching (tests/execution/test_executor.py)
def test_quickstart_pipeline(ray_local, tmp_path):
    import experiments.quickstart as qs

    result = executor_main(ExecutorMainConfig(prefix=str(tmp_path), progress=False),
                           steps=[qs.mixture_report, qs.health, qs.evaluation])
    assert set(result.outcome.values()) == {"succeeded"}, result.errors
    assert len(result.outcome) == 10
    # dedup -> decontamination -> tokenize: what was tokenized is what survived both, document for document
    with open(os.path.join(result.plan.planned(qs.deduped).output_path, "dedup_manifest.json")) as f:
        dedup = json.load(f)
    with open(os.path.join(result.plan.planned(qs.clean).output_path, "decontamination_manifest.json")) as f:
        decon = json.load(f)
    assert decon["totals"]["documents_in"] == dedup["totals"]["documents_out"] > 0
    assert list(decon["against"]) == ["quickstart_task"]
    # the planted faults, each found: one document of each planted pair, each contaminated document
    assert dedup["totals"]["removed"] == {"exact_duplicate": qs.PLANTED["exact_duplicates"],
                                          "near_duplicate": qs.PLANTED["near_duplicates"]}
    assert decon["totals"]["removed"] == {"contaminated": qs.PLANTED["contaminated"]}
    with open(os.path.join(result.plan.planned(qs.tokenized).output_path, "manifest.json")) as f:
        assert json.load(f)["totals"]["documents"] == decon["totals"]["documents_out"] > 0
    path = result.plan.planned(qs.train).output_path
    records = read_metrics(path)
    assert [r["step"] for r in records] == list(range(1, qs.TRAIN_STEPS + 1))
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert {r["transport"] for r in records[:40]} == {"fixed"} and {r["transport"] for r in records[40:]} == {
        "dropless"
    }
    assert {r["seq_len"] for r in records} == {64, 128}
    assert len({r["tokens"] - p["tokens"] for p, r in zip(records, records[1:])}) == 1  # constant tokens/step
    assert glob.glob(os.path.join(path, "wandb", "offline-run-*", "*.wandb"))
    with open(os.path.join(result.plan.planned(qs.health).output_path, "health.json")) as f:
        assert json.load(f)["ok"] is True

    # the eval step: bits per byte of the final checkpoint on the 40 domains' held-out documents;
    # the domains the mixture trains on are predicted far better than the ones it never sees
    with open(os.path.join(result.plan.planned(qs.evaluation).output_path, "eval.json")) as f:
        ev = json.load(f)
    assert ev["step"] == qs.TRAIN_STEPS and len(ev["sets"]) == 40
    trained = [ev["sets"][f"val/{d}"]["bpb"] for d in qs.DOMAIN_WEIGHTS]
    assert max(trained) < ev["macro_bpb"] - 1.0, (trained, ev["macro_bpb"])

    again = executor_main(ExecutorMainConfig(prefix=str(tmp_path), progress=False),
                          steps=[qs.mixture_report, qs.health, qs.evaluation])
    assert set(again.outcome.values()) == {"cached"}
