"""A small K40-shaped corpus, its tokenizer and token store, and one tiny training run with
in-training evaluation, shared by the evaluation tests."""

from __future__ import annotations

import pytest

EVAL_DOMAINS = ("council", "infra", "web_code", "science")


@pytest.fixture(scope="session")
def eval_corpus(tmp_path_factory) -> str:
    from marin.data.synthetic import SyntheticK40Config, generate_k40_miniature

    root = str(tmp_path_factory.mktemp("k40eval"))
    generate_k40_miniature(SyntheticK40Config(root, total_bytes=300_000, seed=5, domains=EVAL_DOMAINS))
    return root


@pytest.fixture(scope="session")
def eval_tokenizer(eval_corpus, tmp_path_factory) -> str:
    from marin.data.tokenizer import TrainTokenizerConfig, train_tokenizer

    out = str(tmp_path_factory.mktemp("evaltok"))
    train_tokenizer(TrainTokenizerConfig(eval_corpus, out, vocab_size=512))
    return out


@pytest.fixture(scope="session")
def eval_store(eval_corpus, eval_tokenizer, tmp_path_factory) -> str:
    from marin.data.tokenize import TokenizeConfig, tokenize

    out = str(tmp_path_factory.mktemp("evalstore"))
    tokenize(TokenizeConfig(eval_corpus, eval_tokenizer, out, show_progress=False, use_ray=False))
    return out


TRAIN_STEPS = 40


@pytest.fixture(scope="session")
def trained_run(eval_store, tmp_path_factory):
    """A tiny MoE trained for TRAIN_STEPS steps on the local-cpu pool (EP over 8 fake devices),
    evaluated on the mixture's held-out split every 15 steps and at the last (40), with checkpoints
    at the same steps. Its weights are fsdp-sharded, so in-training evaluation reads sharded state
    while the standalone evaluator places the checkpoint's whole arrays."""
    from marin.data.mixture import MixtureConfig
    from marin.training.config import TrainConfig
    from marin.training.trainer import run_training

    out = str(tmp_path_factory.mktemp("run"))
    cfg = TrainConfig(output_path=out, data=MixtureConfig(stores=(eval_store,), validation_fraction=0.05),
                      model="tiny-ep", pool="local-cpu", train_steps=TRAIN_STEPS, tokens_per_step=2048,
                      seq_len_phases=((0.0, 64),), peak_lr=1e-2, warmup_steps=4, checkpoint_every_steps=15,
                      checkpoint_every_minutes=None, keep_last_checkpoints=3, wandb_project=None,
                      eval_every_steps=15, param_sharding="fsdp")
    run_training(cfg, use_ray=False)
    return cfg
