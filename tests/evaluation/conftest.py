"""A small K40-shaped corpus, its tokenizer and token store, a domain-continuation task in its
languages, and one tiny training run with in-training evaluation, shared by the evaluation tests."""

from __future__ import annotations

import pytest

EVAL_DOMAINS = ("council", "infra", "web_code", "science")


@pytest.fixture(scope="session")
def eval_corpus(k40_data) -> str:
    return k40_data.corpus("k40eval", total_bytes=300_000, seed=5, domains=EVAL_DOMAINS)


@pytest.fixture(scope="session")
def eval_tokenizer(k40_data, eval_corpus) -> str:
    return k40_data.tokenizer("evaltok", eval_corpus, vocab_size=512)


@pytest.fixture(scope="session")
def eval_store(k40_data, eval_corpus, eval_tokenizer) -> str:
    return k40_data.store("evalstore", eval_corpus, eval_tokenizer)


@pytest.fixture(scope="session")
def eval_task(k40_data) -> str:
    """task.jsonl: 16 four-choice questions, continue a passage in its own domain's language (the
    corpus's seed, so the languages are the ones the run trains on)."""
    from marin.evaluation.multiple_choice import DomainTaskConfig, write_domain_task

    out = k40_data.once("evaltask", (EVAL_DOMAINS, 4, 4, 5), lambda out: write_domain_task(DomainTaskConfig(
        output_path=out, domains=EVAL_DOMAINS, questions_per_domain=4, n_choices=4, seed=5)))
    return f"{out}/task.jsonl"


TRAIN_STEPS = 40


@pytest.fixture(scope="session")
def trained_run(k40_data, eval_store, eval_task):
    """A tiny MoE trained for TRAIN_STEPS steps on the local-cpu pool (EP over 8 fake devices),
    evaluated on the mixture's held-out split and the domain task every 15 steps and at the last
    (40), with checkpoints at the same steps. Its weights are fsdp-sharded, so in-training evaluation
    reads sharded state while the standalone evaluator places the checkpoint's whole arrays. Trained
    once per test run (the workers share it); a test that changes the run copies it first."""
    from marin.data.mixture import MixtureConfig
    from marin.training.config import (
        AdamWConfig,
        CheckpointPolicy,
        ParallelismConfig,
        TelemetryConfig,
        TrainConfig,
        TrainEvalConfig,
    )
    from marin.training.trainer import run_training

    def config(out: str) -> TrainConfig:
        return TrainConfig(output_path=out, data=MixtureConfig(stores=(eval_store,), validation_fraction=0.05),
                           model="tiny-ep", pool="local-cpu", train_steps=TRAIN_STEPS, tokens_per_step=2048,
                           seq_len_phases=((0.0, 64),), optimizer=AdamWConfig(peak_lr=1e-2, warmup_steps=4),
                           checkpoint=CheckpointPolicy(every_steps=15, every_minutes=None, keep_last=3),
                           telemetry=TelemetryConfig(wandb_project=None),
                           evaluation=TrainEvalConfig(every_steps=15, tasks={"k40_domains": eval_task}),
                           parallelism=ParallelismConfig(param_sharding="fsdp"))

    out = k40_data.once("trainedrun", (eval_store, eval_task, TRAIN_STEPS), lambda out: run_training(
        config(out), use_ray=False))
    return config(out)
