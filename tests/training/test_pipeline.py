"""The README's main job end to end (experiments/quickstart.py): miniature K40 -> tokenizer ->
tokenize -> mixture -> a tiny MoE training run on local Ray with EP over fake CPU devices -> health.
Loss falls, the transport hot-switches, the sequence length extends, metrics.jsonl and W&B files
are written, and the health report is clear."""

import glob
import json
import os

from marin.execution import ExecutorMainConfig, executor_main
from marin.training.metrics import read_metrics


def test_quickstart_pipeline(ray_local, tmp_path):
    import experiments.quickstart as qs

    result = executor_main(ExecutorMainConfig(prefix=str(tmp_path), progress=False),
                           steps=[qs.mixture_report, qs.health])
    assert set(result.outcome.values()) == {"succeeded"}, result.errors
    assert len(result.outcome) == 6
    path = result.plan.planned(qs.train).output_path
    records = read_metrics(path)
    assert [r["step"] for r in records] == list(range(1, qs.TRAIN_STEPS + 1))
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 1.0, (first, last)
    assert {r["transport"] for r in records[:40]} == {"fixed"} and {r["transport"] for r in records[40:]} == {"dropless"}
    assert {r["seq_len"] for r in records} == {64, 128}
    assert len({r["tokens"] - p["tokens"] for p, r in zip(records, records[1:])}) == 1  # constant tokens/step
    assert glob.glob(os.path.join(path, "wandb", "offline-run-*", "*.wandb"))
    with open(os.path.join(result.plan.planned(qs.health).output_path, "health.json")) as f:
        assert json.load(f)["ok"] is True

    again = executor_main(ExecutorMainConfig(prefix=str(tmp_path), progress=False), steps=[qs.mixture_report, qs.health])
    assert set(again.outcome.values()) == {"cached"}
