"""The README's main job end to end: miniature K40 -> tokenizer -> tokenize -> mixture -> a tiny MoE
training run on local Ray with EP over fake CPU devices; loss falls; metrics.jsonl and W&B files."""

import glob
import os

import pytest

from marin.execution import ExecutorMainConfig, executor_main
from marin.training.metrics import read_metrics


@pytest.mark.slow
def test_k40_to_tiny_moe_training(ray_local, tmp_path):
    from experiments.defaults import (
        default_k40_miniature,
        default_mixture,
        default_tokenize,
        default_tokenizer,
        default_train,
    )

    corpus = default_k40_miniature(total_bytes=400_000)
    tokenizer = default_tokenizer("tokenizers/k40-mini", corpus, vocab_size=512)
    tokenized = default_tokenize("tokenized/k40-mini", corpus, tokenizer)
    train = default_train(
        "train/k40-mini-tiny-ep",
        mixture=default_mixture([tokenized]),
        model="tiny-ep",
        pool="local-cpu",
        train_steps=30,
        tokens_per_step=2048,
        seq_len_phases=((0.0, 32), (0.5, 64)),
        warmup_steps=3,
        peak_lr=1e-2,
        checkpoint_every_steps=10,
        transport_switches=((0, "fixed"), (20, "dropless")),
        wandb_project="marin-test",
    )
    result = executor_main(ExecutorMainConfig(prefix=str(tmp_path), progress=False), steps=[train])
    assert set(result.outcome.values()) == {"succeeded"}, result.errors
    [path] = [p for p in result.outcome if "train/" in p]
    records = read_metrics(path)
    assert len(records) == 30
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert {r["transport"] for r in records[20:]} == {"dropless"}
    assert {r["seq_len"] for r in records} == {32, 64}
    assert glob.glob(os.path.join(path, "wandb", "offline-run-*", "*.wandb"))
