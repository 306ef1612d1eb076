"""Every default builder: if a value changes what the step writes, it is in the version.

Planning only (no Ray, nothing runs): for each builder, every config field is a versioned leaf
except the documented placeholders / work-spreading settings, and flipping each builder argument
moves the step's hash (and a dependent's).
"""

from __future__ import annotations

import dataclasses

import pytest

from experiments.defaults import (
    TOKENIZE_UNVERSIONED,
    default_health_report,
    default_k40_miniature,
    default_mixture,
    default_mixture_report,
    default_tokenize,
    default_tokenizer,
    default_train,
)
from marin.data.mixture import MixtureConfig, MixtureStage
from marin.data.synthetic import SyntheticK40Config
from marin.data.tokenize import TokenizeConfig
from marin.data.tokenizer import TrainTokenizerConfig
from marin.execution import plan_steps


def _corpus(**kw):
    return default_k40_miniature("c/corpus", **kw)


def _tokenizer(corpus=None, **kw):
    return default_tokenizer("c/tok", corpus or _corpus(), **kw)


def _tokenized(corpus=None, tokenizer=None, **kw):
    corpus = corpus or _corpus()
    return default_tokenize("c/tokenized", corpus, tokenizer or _tokenizer(corpus), **kw)


def _mixture(**kw):
    return default_mixture([_tokenized()], **kw)


def _report(mixture=None, **kw):
    return default_mixture_report("c/report", mixture or _mixture(), **kw)


def _train(mixture=None):
    return default_train("c/train", mixture=mixture or _mixture(), model="tiny", wandb_project=None)


def _plan(step, prefix="/tmp/marin-test-prefix"):
    plan = plan_steps([step], prefix)
    return plan, plan.planned(step)


def _leaves(step) -> set[str]:
    return set(_plan(step)[1].config_leaves)


def _fields(cls, prefix: str = "") -> set[str]:
    return {prefix + f.name for f in dataclasses.fields(cls)}


def test_every_field_that_can_change_the_output_is_a_leaf():
    assert _leaves(_corpus()) == _fields(SyntheticK40Config)
    assert _leaves(_tokenizer()) == _fields(TrainTokenizerConfig)
    # input_path and tokenizer are inputs (their upstream's version), the rest is how the work is spread
    assert _leaves(_tokenized()) == _fields(TokenizeConfig) - set(TOKENIZE_UNVERSIONED) | {"input_path", "tokenizer",
                                                                                          "output_path"}
    mixture_leaves = _fields(MixtureConfig, "mixture.") - {"mixture.stores"} | {"mixture.stores[0]"}
    assert _leaves(_report()) == mixture_leaves | {"output_path", "total_tokens", "total_steps"}
    assert {"data" + leaf[len("mixture"):] for leaf in mixture_leaves} <= _leaves(_train())


CASES = {
    "k40": (_corpus, [{"total_bytes": 123_456}, {"seed": 1}, {"domains": ("council",)}, {"files_per_source": 2}]),
    "tokenizer": (lambda **kw: _tokenizer(**kw), [
        {"vocab_size": 1000}, {"max_bytes": 10}, {"text_field": "body"}, {"min_frequency": 3},
        {"on_corrupt": "fail"}, {"max_corrupt_fraction": 0.5}]),
    "tokenize": (lambda **kw: _tokenized(**kw), [
        {"sources": {"a": "council"}}, {"text_field": "body"}, {"max_doc_bytes": 10}, {"shard_max_tokens": 10},
        {"on_corrupt": "fail"}, {"max_corrupt_fraction": 0.5}]),
    "mixture_report": (lambda **kw: _report(_mixture(**kw)), [
        {"domain_weights": {"council": 2.0}}, {"quality_weights": {"q1": 0.5}},
        {"domain_quality_weights": {"council": {"q1": 2.0}}}, {"stages": (MixtureStage(10, {"council": 1.0}),)},
        {"seed": 1}, {"validation_fraction": 0.1}, {"validation_max_documents": 10}]),
    "mixture_report_tokens": (lambda **kw: _report(**kw), [{"total_tokens": 1000}, {"total_steps": 500}]),
    "health": (lambda **kw: default_health_report("c/health", _train(), **kw), [{"total_steps": 7}]),
}


@pytest.mark.parametrize("builder,flip", [(b, f) for b, (_, flips) in CASES.items() for f in flips],
                         ids=lambda x: x if isinstance(x, str) else ",".join(x))
def test_flipping_a_versioned_argument_moves_the_hash(builder, flip):
    make, _ = CASES[builder]
    assert _plan(make(**flip))[1].hash != _plan(make())[1].hash


@pytest.mark.parametrize("upstream", ["corpus", "tokenizer", "tokenize", "mixture"])
def test_an_upstream_change_reaches_the_training_step(upstream):
    corpus = _corpus(seed=1 if upstream == "corpus" else 0)
    tok = _tokenizer(corpus, vocab_size=1000 if upstream == "tokenizer" else 8192)
    tokenized = default_tokenize("c/tokenized", corpus, tok, max_doc_bytes=10 if upstream == "tokenize" else 8_000_000)
    mixture = default_mixture([tokenized], seed=1 if upstream == "mixture" else 0)
    assert _plan(_train(mixture))[1].hash != _plan(_train())[1].hash


@pytest.mark.parametrize("field,value", [("num_cpus_per_task", 4.0), ("show_progress", False), ("use_ray", False)])
def test_how_tokenize_spreads_its_work_keeps_the_store(field, value):
    step = _tokenized()
    other = _tokenized()
    object.__setattr__(other.config, field, value)
    assert _plan(other)[1].hash == _plan(step)[1].hash
