"""Multiple-choice log-likelihood tasks on a task built from the K40 miniature: continue a passage in
its own domain's language. A trained tiny model beats chance clearly; an untrained one does not."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from marin.data.tokenizer import load_tokenizer
from marin.evaluation.multiple_choice import (
    Question,
    TaskError,
    accuracy,
    choice_logliks,
    encode_pair,
    read_task,
    score_task,
)
from marin.models.transformer import forward, init_params, init_router_bias
from marin.parallel.mesh import make_mesh
from marin.training.trainer import model_config

EVAL_DOMAINS = ("council", "infra", "web_code", "science")  # the domains of the eval_corpus fixture


def _domain_task(path: str, n_per_domain: int = 12) -> str:
    """Context: the first 8 words of a fresh (never trained on) q5 document's body; choices: the
    next 6 words of that document and of documents at the same index in the other domains."""
    from marin.data.synthetic import generate_documents

    bodies = {d: [t.split("\n", 1)[1].split() for t in generate_documents(d, "q5", n_per_domain, seed=5, start=50_000)]
              for d in EVAL_DOMAINS}
    with open(path, "w") as f:
        for i in range(n_per_domain):
            for gi, d in enumerate(EVAL_DOMAINS):
                choices = [" " + " ".join(bodies[o][i][8:14]) for o in EVAL_DOMAINS]
                f.write(json.dumps({"context": " ".join(bodies[d][i][:8]), "choices": choices, "gold": gi}) + "\n")
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return read_task(_domain_task(str(tmp_path_factory.mktemp("task") / "k40_domains.jsonl")))


def test_untrained_model_is_at_chance_and_logliks_match_a_reference(eval_tokenizer, task):
    tok = load_tokenizer(eval_tokenizer)
    cfg = model_config(_train_config("unused"))
    params, bias = init_params(cfg, jax.random.PRNGKey(0)), init_router_bias(cfg)
    res = score_task(task, tok, params, bias, cfg, make_mesh(1, 1), 64, 16)
    assert res["questions"] == 48 and res["chance"] == pytest.approx(0.25)
    assert res["acc"] <= 0.4 and res["acc_norm"] <= 0.4, res
    # reference: one unpacked forward over [EOS] + context + choice, summing the choice's log-probs
    # (right-padded to one shape so it compiles once; causal attention never sees the padding)
    fwd = jax.jit(lambda p, b, x: jax.nn.log_softmax(forward(p, b, x, cfg.replace(transport="local"))[0]))
    ll = choice_logliks(task[:2], tok, params, bias, cfg, make_mesh(1, 1), 64, 16)
    for q, got in zip(task[:2], ll):
        for c, value in zip(q.choices, got):
            ctx, cont = encode_pair(tok, q.context, c)
            s = np.array([tok.eos_id, *ctx, *cont])
            x = np.zeros((1, 64), np.int32)
            x[0, :len(s) - 1] = s[:-1]
            logp = np.asarray(fwd(params, bias, x)[0])
            ref = float(sum(logp[len(ctx) + i, t] for i, t in enumerate(cont)))
            assert value == pytest.approx(ref, rel=1e-4)


def test_accuracy_is_argmax_and_byte_normalised():
    qs = [Question("c", ("a", "bbbb"), 1), Question("c", ("a", "bb"), 0)]
    res = accuracy(qs, [np.array([-1.0, -2.0]), np.array([-1.0, -1.5])])
    # q0: raw picks "a" (wrong), per byte -1 vs -0.5 picks "bbbb" (right); q1: raw right, per byte wrong
    assert res == {"questions": 2, "acc": 0.5, "acc_norm": 0.5, "chance": 0.5}


def test_pair_encoding_and_bad_files(eval_tokenizer, tmp_path):
    tok = load_tokenizer(eval_tokenizer)
    ctx, cont = encode_pair(tok, "the council ", "votes")
    assert tok.decode(ctx) + tok.decode(cont) == "the council votes"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"context": "x", "choices": ["a"], "gold": 0}) + "\n")
    with pytest.raises(TaskError, match="line 1: needs >= 2 choices"):
        read_task(str(bad))
    with pytest.raises(TaskError, match="not found"):
        read_task(str(tmp_path / "missing.jsonl"))


def _train_config(out: str, store: str | None = None, steps: int = 200):
    from marin.data.mixture import MixtureConfig
    from marin.training.config import AdamWConfig, CheckpointPolicy, TelemetryConfig, TrainConfig

    return TrainConfig(output_path=out, data=MixtureConfig(stores=(store or "unused",)), model="tiny-ep",
                       pool="local-cpu-1", train_steps=steps, tokens_per_step=2048, seq_len_phases=((0.0, 64),),
                       optimizer=AdamWConfig(peak_lr=1e-2, warmup_steps=4),
                       checkpoint=CheckpointPolicy(every_steps=1000, every_minutes=None),
                       telemetry=TelemetryConfig(wandb_project=None, progress_every_s=1e9))


@pytest.mark.slow
def test_trained_model_beats_chance_clearly(eval_store, eval_tokenizer, task, tmp_path):
    """~2 minutes on a 2-core VM: 200 steps x 2,048 tokens of the tiny MoE."""
    from marin.training.checkpoint import load_model
    from marin.training.trainer import run_training

    cfg = _train_config(str(tmp_path / "run"), eval_store)
    run_training(cfg, use_ray=False)
    model = load_model(cfg.output_path, step=cfg.train_steps)
    res = score_task(task, load_tokenizer(eval_tokenizer), model.params, model.router_bias, model.config,
                     make_mesh(1, 1), 64, 16)
    assert res["acc"] >= 0.5 and res["acc_norm"] >= 0.5, res  # chance is 0.25
