"""Every default builder: if a value changes what the step writes, it is in the version.

Planning only (no Ray, nothing runs): for each builder, the versioned leaves are derived from
``dataclasses.fields()`` of its config and the rule each field declares
(:mod:`marin.execution.versioning`), so a field added tomorrow is expected in the version unless
someone marks it live; and flipping each builder argument moves the step's hash (and a dependent's).
"""

from __future__ import annotations

import dataclasses

import pytest

from experiments.defaults import (
    default_decontaminate,
    default_dedup,
    default_domain_assign,
    default_domain_fit,
    default_eval,
    default_health_report,
    default_k40_layout,
    default_k40_miniature,
    default_ladder_fit,
    default_mixture,
    default_mixture_report,
    default_quality_classifier,
    default_quality_examples,
    default_raw_text,
    default_report,
    default_tokenize,
    default_tokenizer,
    default_train,
)
from marin.data.corpus_steps import CorpusInput
from marin.data.domains import Embedding
from marin.data.mixture import MixtureConfig, MixtureStage
from marin.data.mixture_report import MixtureReportConfig
from marin.data.ngram_features import HashedNgrams
from marin.data.synthetic import SyntheticK40Config
from marin.data.tokenize import TokenizeConfig
from marin.data.tokenizer import TrainTokenizerConfig
from marin.evaluation.sets import EvalSet
from marin.execution import plan_steps
from marin.execution.plan import plain_config
from marin.execution.versioning import rule, versioned_leaves
from marin.inference.evaluate import EvalConfig
from marin.models.config import MoEConfig
from marin.monitoring.health import HealthReportConfig
from marin.review.report import ReportConfig
from marin.scaling.ladder import LadderFitConfig, RungRun
from marin.training.config import SyntheticDataConfig, TelemetryConfig, TrainConfig, TrainEvalConfig


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
    return default_train("c/train", mixture=mixture or _mixture(), model="tiny",
                         telemetry=TelemetryConfig(wandb_project=None))


def _plan(step, prefix="/tmp/marin-test-prefix"):
    plan = plan_steps([step], prefix)
    return plan, plan.planned(step)


def _leaves(step) -> set[str]:
    return set(_plan(step)[1].config_leaves)


def _inputs(cls, prefix: str = "") -> set[str]:
    """Input fields holding one placeholder: the placeholder is a leaf (its upstream's digest)."""
    return {prefix + f.name for f in dataclasses.fields(cls) if rule(f)[0] == "input"}


def test_every_field_that_can_change_the_output_is_a_leaf():
    assert _leaves(_corpus()) == versioned_leaves(SyntheticK40Config) | _inputs(SyntheticK40Config)
    assert _leaves(_tokenizer()) == versioned_leaves(TrainTokenizerConfig) | _inputs(TrainTokenizerConfig)
    # input_path and tokenizer are inputs (their upstream's version); live fields (how the work is spread) are out
    assert _leaves(_tokenized()) == versioned_leaves(TokenizeConfig) | _inputs(TokenizeConfig)
    # order is added later (legacy by default) and default_mixture sets the current one: a leaf here
    mixture_leaves = versioned_leaves(MixtureConfig, "mixture") | {"mixture.stores[0]", "mixture.order"}
    assert _leaves(_report()) == (versioned_leaves(MixtureReportConfig, nested={"mixture": MixtureConfig})
                                  | mixture_leaves | {"output_path"}) - {"mixture"}
    train_leaves = _leaves(_train())
    expected = versioned_leaves(TrainConfig, nested={"model": MoEConfig, "data": MixtureConfig})
    # init_from (a branch's source) is None here, and None adds nothing (tests/training/test_branch.py)
    assert train_leaves == expected - {"init_from"} | {"data.stores[0]", "data.order", "output_path"}


def test_synthetic_data_and_every_eval_and_fit_config_follow_their_metadata():
    synthetic = default_train("c/train", mixture=SyntheticDataConfig(), model="tiny")
    assert _leaves(synthetic) == versioned_leaves(TrainConfig, nested={"model": MoEConfig}) - {"init_from"} | {
        "output_path"}
    train = _train()
    ev = default_eval("c/eval", train, eval_sets=[EvalSet("web", "/data/web-store")], held_out=True)
    set_leaves = {"sets[0]." + leaf for leaf in versioned_leaves(EvalSet) | {"store"}}
    assert _leaves(ev) == versioned_leaves(EvalConfig) - {"sets"} | set_leaves | _inputs(EvalConfig)
    health = default_health_report("c/health", train, total_steps=7)
    assert _leaves(health) == versioned_leaves(HealthReportConfig) | {"run_path", "output_path"}
    report = default_report("c/report", [train])
    assert _leaves(report) == versioned_leaves(ReportConfig) | {"step_paths[0]", "output_path"}
    fit = default_ladder_fit("c/fit", [(train, ev)], train)
    rung = versioned_leaves(RungRun)
    assert _leaves(fit) == (versioned_leaves(LadderFitConfig) - {"rungs", "target", "validation"}
                            | {f"rungs[0].{x}" for x in rung | {"run_path", "eval_path"}}
                            | {f"target.{x}" for x in rung} | {"output_path"})


def test_a_new_config_field_is_versioned_unless_marked_live():
    """The rule's default: a field without metadata is a versioned leaf (the stale-cache defect stays fixed)."""
    from marin.execution.versioning import input_field, live, versioned_config

    @dataclasses.dataclass(frozen=True)
    class Config:
        output_path: str = input_field()
        old: int = 1
        added_tomorrow: int = 2
        cadence: int = live("how often it logs", default=3)

    from marin.execution import ExecutorStep, this_output_path

    step = ExecutorStep("c/new", print, versioned_config(Config(this_output_path())))
    assert _leaves(step) == versioned_leaves(Config) | {"output_path"} == {"old", "added_tomorrow", "output_path"}
    with pytest.raises(ValueError, match="needs a reason"):
        live(" ")


def test_a_field_added_later_keeps_the_recorded_hashes_until_it_is_set():
    """Adding a versioned field with a default would rename every recorded step; ``added_later`` keeps
    the old hash for the default and versions any other value."""
    from marin.execution import ExecutorStep, this_output_path
    from marin.execution.versioning import added_later, input_field, versioned_config

    @dataclasses.dataclass(frozen=True)
    class Before:
        output_path: str = input_field()
        old: int = 1

    @dataclasses.dataclass(frozen=True)
    class After:
        output_path: str = input_field()
        old: int = 1
        init_from: str | None = added_later(default=None)

    def step(cfg):
        return ExecutorStep("c/added", print, versioned_config(cfg))

    before = _plan(step(Before(this_output_path())))[1]
    assert _plan(step(After(this_output_path())))[1].hash == before.hash
    moved = _plan(step(After(this_output_path(), init_from="/ckpt/step-100")))[1]
    assert moved.hash != before.hash and moved.config_leaves["init_from"] == "/ckpt/step-100"
    with pytest.raises(ValueError, match="needs a default"):
        added_later()
    with pytest.raises(TypeError, match=r"takes a config dataclass instance, got dict; wrap a plain value"):
        versioned_config({"lr": 1e-3})


INPUT_FLIPS = [{"sources": {"a": "council"}}, {"text_field": "body"}, {"max_doc_bytes": 10},
               {"on_corrupt": "fail"}, {"max_corrupt_fraction": 0.5}]
"""Every versioned field of a corpus step's input group (CorpusInput)."""

CASES = {
    "k40": (_corpus, [{"total_bytes": 123_456}, {"seed": 1}, {"domains": ("council",)}, {"files_per_source": 2}]),
    "tokenizer": (lambda **kw: _tokenizer(**kw), [
        {"vocab_size": 1000}, {"max_bytes": 10}, {"min_frequency": 3},
        *({"input": CorpusInput(**flip)} for flip in INPUT_FLIPS if set(flip) <= {"text_field", "on_corrupt",
                                                                                    "max_corrupt_fraction"})]),
    "tokenize": (lambda **kw: _tokenized(**kw), [
        *({"input": CorpusInput(**flip)} for flip in INPUT_FLIPS), {"shard_max_tokens": 10}]),
    "dedup": (lambda **kw: default_dedup("c/dedup", _corpus(), **kw), [
        *({"input": CorpusInput(**flip)} for flip in INPUT_FLIPS), {"exact": False}, {"shingle_size": 4},
        {"bands": 10}, {"threshold": 0.8}, {"seed": 2}, {"scope": "domain"}]),
    "decontaminate": (lambda **kw: default_decontaminate("c/decon", _corpus(), ["/eval/a.jsonl"], **kw), [
        *({"input": CorpusInput(**flip)} for flip in INPUT_FLIPS), {"ngram": 8}, {"mode": "cut"}]),
    "raw_text": (lambda **kw: default_raw_text("c/raw", _corpus(), **kw), [{"files": 2}, {"seed": 1}]),
    "domain_fit": (lambda **kw: default_domain_fit("c/fit", _corpus(), **kw), [
        *({"input": CorpusInput(**flip)} for flip in INPUT_FLIPS), {"k": 20}, {"sample_documents": 10},
        {"n_init": 2}, {"seed": 1}, {"embedding": Embedding(dims=32)},
        {"embedding": Embedding(features=HashedNgrams(n_features=1 << 17, ngram_max=1))},
        {"embedding": Embedding(model="mylab.embed:encode")}, {"embedding": Embedding(version="2")}]),
    "domain_assign": (lambda **kw: default_domain_assign("c/assign", _corpus(), default_domain_fit("c/fit", _corpus()),
                                                         **kw), [
        *({"input": CorpusInput(**flip)} for flip in INPUT_FLIPS)]),
    "quality_classifier": (lambda **kw: default_quality_classifier("c/q", **{"positive": ["/p"], "negative": ["/n"],
                                                                             **kw}), [
        {"positive": ["/p2"]}, {"negative": ["/n", "/m"]}, {"C": 2.0}, {"max_examples": 10}, {"seed": 1},
        {"text_field": "body"}]),
    "quality_examples": (lambda **kw: default_quality_examples("c/ex", **kw), [
        {"per_domain": 3}, {"seed": 1}, {"domains": ("council",)}]),
    "k40_layout": (lambda **kw: default_k40_layout(
        "c/k40", _corpus(), default_domain_assign("c/assign", _corpus(), default_domain_fit("c/fit", _corpus())),
        default_quality_classifier("c/q", ["/p"], ["/n"]), **kw), [
        *({"input": CorpusInput(**flip)} for flip in INPUT_FLIPS), {"bucketing": "global"},
        {"output_format": "jsonl"}, {"tokenizer": "/tok.json"}]),
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
    tokenized = default_tokenize("c/tokenized", corpus, tok,
                                 CorpusInput(max_doc_bytes=10 if upstream == "tokenize" else 8_000_000))
    mixture = default_mixture([tokenized], seed=1 if upstream == "mixture" else 0)
    assert _plan(_train(mixture))[1].hash != _plan(_train())[1].hash


@pytest.mark.parametrize("field,value", [("num_cpus_per_task", 4.0), ("show_progress", False), ("use_ray", False),
                                         ("min_task_bytes", 0), ("allow_empty", True)])
def test_how_a_corpus_step_spreads_its_work_keeps_its_output(field, value):
    assert _plan(_tokenized(input=CorpusInput(**{field: value})))[1].hash == _plan(_tokenized())[1].hash


def test_the_tokenizer_takes_the_corpus_steps_input_group_and_refuses_what_it_does_not_read():
    """The same CorpusInput serves the tokenizer and the tokenize step: the trainer reads its text field
    and corrupt-input policy (versioned as its config's own fields) and ignores how the work is spread;
    a source list, a size limit or allow_empty, which it has no way to honour, is refused in one line."""
    body = CorpusInput(text_field="body", on_corrupt="fail", use_ray=False, min_task_bytes=0)
    tok = plain_config(_tokenizer(input=body).config)
    assert (tok.text_field, tok.on_corrupt, tok.max_corrupt_fraction) == ("body", "fail", body.max_corrupt_fraction)
    spread_by_default = CorpusInput(text_field="body", on_corrupt="fail")
    assert _plan(_tokenizer(input=body))[1].hash == _plan(_tokenizer(input=spread_by_default))[1].hash
    for unread in ({"sources": {"web": "web/*.jsonl"}}, {"max_doc_bytes": 10}, {"allow_empty": True}):
        name = next(iter(unread))
        with pytest.raises(ValueError, match=rf"default_tokenizer reads text_field, on_corrupt, max_corrupt_fraction "
                                             rf"of input=, not {name}=.*: it samples every document file under its "
                                             r"corpus; pass a corpus path holding only what it should learn from"):
            _tokenizer(input=CorpusInput(**unread))


def test_an_eval_suite_reads_each_set_with_the_input_group_given():
    """default_eval_suite takes the corpus steps' input group: each set is one source of its own
    tokenize step, read with the group's text field; a group with sources of its own is refused."""
    from experiments.defaults import default_eval_suite

    suite = {"c4": "gs://b/c4/val/*.jsonl.gz", "wiki": "s3://b/wiki/val.jsonl"}
    sets = default_eval_suite(suite, "/tok.json", CorpusInput(text_field="body"), prefix="e")
    stores = [s.store for s in sets]
    assert [st.step.name for st in stores] == ["e/c4", "e/wiki"]
    inputs = [plain_config(st.step.config).input for st in stores]
    assert [(i.sources, i.text_field) for i in inputs] == [({"c4": "*.jsonl.gz"}, "body"), ({"wiki": ""}, "body")]
    with pytest.raises(ValueError, match=r"default_eval_suite: each set's files are its suite entry; pass input= "
                                         r"without sources \(got sources=\{'x': 'y'\}\)"):
        default_eval_suite(suite, "/tok.json", CorpusInput(sources={"x": "y"}))


def test_versioned_fields_are_a_leaf_each_named_as_before_the_input_group():
    """The input group's fields are named in the version as the configs' own fields were (``text_field``,
    not ``input.text_field``), so grouping them moved no step's hash (the pinned hashes hold the proof)."""
    names = {"sources", "text_field", "max_doc_bytes", "on_corrupt", "max_corrupt_fraction"}
    for step in (_tokenized(), default_dedup("c/dedup", _corpus()), default_decontaminate("c/d", _corpus())):
        assert names <= _leaves(step) and not any(leaf.startswith("input.") for leaf in _leaves(step))


def test_in_training_tasks_are_telemetry_and_a_task_step_is_a_dependency():
    """evaluation.tasks is live, like evaluation.sets: a path keeps the training step's hash; a task written by a
    step makes that step a dependency (its hash is in the version) and resolves to its task.jsonl."""
    from experiments.defaults import default_domain_task
    from marin.execution import resolve_config

    def train(**tasks):
        return default_train("c/train", mixture=_mixture(), model="tiny", telemetry=TelemetryConfig(wandb_project=None),
                             evaluation=TrainEvalConfig(every_steps=10, tasks=tasks))

    plain = _plan(train())[1]
    assert _plan(train(k40="/tasks/k40.jsonl"))[1].hash == plain.hash
    task = default_domain_task("c/task", ("council", "infra", "web_code", "science"))
    plan, with_step = _plan(train(k40=task))
    assert with_step.hash != plain.hash and plan.planned(task) in with_step.dependencies
    assert resolve_config(with_step, plan).evaluation.tasks == {"k40": f"{plan.planned(task).output_path}/task.jsonl"}
    with pytest.raises(ValueError, match=r"evaluation.tasks \['k40'\] are scored by the in-training eval, which "
                                         r"evaluation.every_steps=None turns off"):
        default_train("c/train", mixture=_mixture(), evaluation=TrainEvalConfig(tasks={"k40": "/tasks/k40.jsonl"}))
    with pytest.raises(ValueError, match="evaluation.tasks need a run on tokenized text; synthetic tokens have no "
                                         "tokenizer"):
        default_train("c/train", mixture=SyntheticDataConfig(),
                      evaluation=TrainEvalConfig(every_steps=5, tasks={"k40": "/t.jsonl"}))
