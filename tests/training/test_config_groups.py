"""TrainConfig grouped by concept: the groups' own checks, the flat spellings of before (deprecated,
still working), the hash rule that keeps every step's hash, the records of before, and a ladder
rung's model followed from the builder into the trainer."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from experiments.defaults import (
    branch_from,
    default_domain_task,
    default_eval_suite,
    default_k40_miniature,
    default_mixture,
    default_tokenize,
    default_train,
)
from marin.execution import ExecutorStep, resolve_config, this_output_path, versioned
from marin.execution.jsonable import to_jsonable
from marin.execution.plan import PlanError, plan_steps, walk_placeholders
from marin.execution.versioning import group, versioned_config
from marin.execution.walker import leaves
from marin.models.config import MoEConfig, get_preset
from marin.review.explain import is_versioned
from marin.training.config import (
    FLAT_NAMES,
    GROUPS,
    CheckpointPolicy,
    OptimizerConfig,
    ParallelismConfig,
    StallRule,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
    TrainEvalConfig,
    train_config_from_record,
)

FLAT_RECORD = Path(__file__).parent / "fixtures" / "flat_train_config_record.json"
"""A run's config record as the trainer wrote it before TrainConfig was grouped (flat, with the
deprecated model_overrides and compute_dtype), every field set to a value other than its default."""


def _grouped_like_the_flat_record() -> TrainConfig:
    """The config of FLAT_RECORD, written in the grouped spelling."""
    from marin.data.mixture import MixtureConfig
    from marin.evaluation.sets import EvalSet
    from marin.training.config import InitFrom

    return TrainConfig(
        output_path="/runs/tiny-abc", data=MixtureConfig(stores=("/stores/a", "/stores/b"), validation_fraction=0.01),
        model=get_preset("tiny", n_layers=2, dtype="bfloat16", max_seq_len=128), preset="tiny", pool="local-cpu-1",
        seed=3, train_steps=40, tokens_per_step=2048, seq_len_phases=((0.0, 32), (0.5, 64)),
        init_from=InitFrom(run="/runs/source-123", step=20, optimizer=False),
        optimizer=OptimizerConfig(peak_lr=2e-3, warmup_steps=4, final_lr_fraction=0.1, lr_replans=((20, 60),),
                                  weight_decay=0.05, beta2=0.99, grad_clip=0.5),
        checkpoint=CheckpointPolicy(every_steps=10, every_minutes=None, keep_last=3, keep_every=20,
                                    temp_every_minutes=15.0, temp_path="/fast/tmp", preemption_grace_s=30.0),
        stall=StallRule(timeout_s=900.0, startup_s=1200.0),
        evaluation=TrainEvalConfig(every_steps=10, sets=(EvalSet(name="val", store="/stores/val"),), held_out=False,
                                   tasks={"k40": "/tasks/task.jsonl"}, stride=16),
        telemetry=TelemetryConfig(log_every=5, wandb_project=None, run_name="tiny-run", progress_every_s=2.0),
        parallelism=ParallelismConfig(microbatches=2, param_sharding="fsdp", remat_by_seq_len=((64, "full"),),
                                      context_parallel_by_seq_len=((64, 2),), transport_switches=((0, "fixed"),)),
    )


def test_a_flat_record_of_before_loads_into_the_grouped_config():
    record = json.loads(FLAT_RECORD.read_text())
    assert "peak_lr" in record and "optimizer" not in record  # as stored before the grouping
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a record is data: reading it warns about nothing
        assert train_config_from_record(record) == _grouped_like_the_flat_record()


def test_a_grouped_record_round_trips():
    config = _grouped_like_the_flat_record()
    record = json.loads(json.dumps(to_jsonable(config)))
    assert record["optimizer"]["peak_lr"] == 2e-3 and "peak_lr" not in record
    assert train_config_from_record(record) == config


def test_each_flat_keyword_still_works_with_a_warning_naming_the_new_spelling():
    from marin.data.mixture import MixtureConfig

    for flat, (group_name, name) in FLAT_NAMES.items():
        value = getattr(getattr(_grouped_like_the_flat_record(), group_name), name)
        with pytest.warns(DeprecationWarning, match=rf"TrainConfig\({flat}=\.\.\.\) is deprecated; use "
                                                    rf"{group_name}={GROUPS[group_name].__name__}\({name}=\.\.\.\)"):
            config = TrainConfig(output_path="x", data=MixtureConfig(stores=("/s",)), model="tiny",
                                 checkpoint=CheckpointPolicy(temp_path="/fast"),
                                 evaluation=TrainEvalConfig(every_steps=1), **{flat: value})
        assert getattr(getattr(config, group_name), name) == value
        with pytest.warns(DeprecationWarning, match=rf"TrainConfig\.{flat} is deprecated; read config"):
            assert getattr(config, flat) == value


def test_replace_with_a_flat_name_updates_its_group_and_keeps_the_rest():
    config = TrainConfig(output_path="x", data=SyntheticDataConfig(),
                         optimizer=OptimizerConfig(peak_lr=1e-3, beta2=0.9))
    with pytest.warns(DeprecationWarning):
        changed = dataclasses.replace(config, warmup_steps=3)
    assert changed.optimizer == OptimizerConfig(peak_lr=1e-3, beta2=0.9, warmup_steps=3)


def test_default_train_names_the_groups_and_refuses_an_unknown_name_listing_them():
    with pytest.raises(TypeError, match=r"unknown TrainConfig field\(s\) peak_lrr; the fields are: .*"
                                        r"optimizer \(AdamWConfig: peak_lr, warmup_steps"):
        default_train("t", mixture=SyntheticDataConfig(), peak_lrr=1.0)
    with pytest.warns(DeprecationWarning, match=r"default_train\(checkpoint_every_steps=\.\.\.\) is deprecated; use "
                                                r"checkpoint=CheckpointPolicy\(every_steps=\.\.\.\)"):
        step = default_train("t", mixture=SyntheticDataConfig(), checkpoint_every_steps=7, memory_check="off")
    assert step.config.checkpoint.every_steps == 7


def test_default_train_defaults_are_train_configs():
    """default_train's signature names the fields; its defaults are TrainConfig's (one set of defaults)."""
    import inspect

    params = inspect.signature(default_train).parameters
    for f in dataclasses.fields(TrainConfig):
        if f.name in params and f.name in GROUPS:
            assert params[f.name].default is None  # None: the group's own defaults
        elif f.name in params and f.name not in ("model", "init_from", "preset"):
            assert params[f.name].default == f.default, f.name


@pytest.mark.parametrize("bad, message", [
    (lambda: OptimizerConfig(beta2=1.0), r"optimizer.beta2 must be in \[0, 1\)"),
    (lambda: OptimizerConfig(peak_lr=0.0), r"optimizer.peak_lr must be > 0"),
    (lambda: ParallelismConfig(param_sharding="zero3"), r"unknown param_sharding 'zero3'"),
    (lambda: ParallelismConfig(remat_by_seq_len=((64, "most"),)), r"unknown remat policy 'most'"),
    (lambda: TrainEvalConfig(tasks={"k": "/t.jsonl"}), r"evaluation.every_steps=None turns off"),
    (lambda: TelemetryConfig(log_every=0), r"log_every >= 1"),
    (lambda: CheckpointPolicy(every_minutes=0), r"every_minutes must be > 0"),
    (lambda: TrainConfig(output_path="x", data=SyntheticDataConfig(),
                         checkpoint=CheckpointPolicy(temp_every_minutes=5)),
     r"needs temp_checkpoint_path \(checkpoint.temp_path"),
])
def test_each_group_checks_its_own_fields(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def _hash_steps():
    """A source run and a branch of it that set every TrainConfig field, with in-training eval sets
    and a task from steps (placeholders inside the evaluation group), in the flat spelling."""
    tok = default_tokenize("h/tok", "/corpus", "/tok.json")
    suite = default_eval_suite({"paloma": "/evals/*.jsonl"}, "/tok.json")
    task = default_domain_task("h/task", ("council", "infra", "web_code", "science"))
    flat = dict(mixture=default_mixture([tok]), model="tiny", model_overrides={"n_layers": 2},
                compute_dtype="bfloat16", pool="local-cpu-1", seed=3, train_steps=40, tokens_per_step=2048,
                seq_len_phases=((0.0, 32), (0.5, 64)), peak_lr=2e-3, warmup_steps=4, final_lr_fraction=0.1,
                lr_replans=((20, 60),), weight_decay=0.05, beta2=0.99, grad_clip=0.5,
                transport_switches=((0, "fixed"),), checkpoint_every_steps=10, checkpoint_every_minutes=None,
                keep_last_checkpoints=3, keep_every_steps=20, stall_timeout_s=900.0, log_every=5,
                wandb_project=None, eval_every_steps=10, eval_sets=suite, eval_held_out=False,
                eval_tasks={"k40": task}, eval_stride=16, microbatches=2, param_sharding="fsdp", memory_check="off")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        src = default_train("h/src", **flat)
        branch = default_train("h/branch", **flat, init_from=branch_from(src, 20))
    grouped = default_train(
        "h/src", mixture=default_mixture([tok]), model=get_preset("tiny", n_layers=2, dtype="bfloat16"),
        preset="tiny", pool="local-cpu-1", seed=3, train_steps=40, tokens_per_step=2048,
        seq_len_phases=((0.0, 32), (0.5, 64)),
        optimizer=OptimizerConfig(peak_lr=2e-3, warmup_steps=4, final_lr_fraction=0.1, lr_replans=((20, 60),),
                                  weight_decay=0.05, beta2=0.99, grad_clip=0.5),
        checkpoint=CheckpointPolicy(every_steps=10, every_minutes=None, keep_last=3, keep_every=20),
        stall=StallRule(timeout_s=900.0), telemetry=TelemetryConfig(log_every=5, wandb_project=None),
        evaluation=TrainEvalConfig(every_steps=10, sets=suite, held_out=False, tasks={"k40": task}, stride=16),
        parallelism=ParallelismConfig(microbatches=2, param_sharding="fsdp", transport_switches=((0, "fixed"),)),
        memory_check="off")
    return src, branch, grouped


def test_grouping_moved_no_hash():
    """The hashes of these steps, pinned (the same code path as the pinned hashes of the shipped
    experiments, tests/experiments/pinned_step_hashes.json): a group's fields are named in the hash
    as the flat fields were (optimizer.peak_lr as peak_lr), so the grouping moved no hash."""
    src, branch, grouped = _hash_steps()
    hashes = {s.name: s.hash for s in plan_steps([src, branch], "/p").steps}
    # (moved when default_mixture's data order became without_replacement_v1: b03ca0197d / 7421e35810
    # before; and when in-training evaluation's dependencies were named by their path, evaluation.sets[0]
    # instead of eval_sets[0]: 1380123cb0 / ff2ae7c274 before)
    assert hashes["h/src"] == "bdf5ff75f6" and hashes["h/branch"] == "c14d6460f3"
    assert plan_steps([grouped], "/p").steps[-1].hash == hashes["h/src"]


def test_records_spell_the_group_and_the_version_names_the_flat_field():
    src, _, _ = _hash_steps()
    ps = plan_steps([src], "/p").steps[-1]
    # the recorded version names the leaves as before the grouping (old and new runs compare leaf by
    # leaf); "spelled" says how the config spells them, so review marks the recorded fields versioned
    assert "peak_lr" in ps.config_leaves and 'evaluation.tasks["k40"]' in ps.config_leaves  # a dependency
    assert ps.version()["spelled"]["peak_lr"] == "optimizer.peak_lr"
    versioned = [*ps.config_leaves, *ps.spelled.values()]
    assert is_versioned("optimizer.peak_lr", versioned) and is_versioned('evaluation.tasks["k40"]', versioned)
    assert not is_versioned("checkpoint.every_steps", versioned)
    assert "spelled" not in plan_steps([default_k40_miniature("h/k40")], "/p").steps[0].version()  # no group
    paths = {str(p): p for p, _ in walk_placeholders(src.config)}  # the versioned leaves, as planning finds them
    assert paths["optimizer.peak_lr"].version_name() == "peak_lr"
    assert paths["evaluation.sets[0].store"].version_name() == "evaluation.sets[0].store"  # by its path
    every = {str(p): p for p, _ in leaves(resolve_config(ps, plan_steps([src], "/p")))}  # live ones too
    assert every["stall.timeout_s"].version_name() == "timeout_s"  # live: never in a hash
    assert every["checkpoint.every_steps"].version_name() == "every_steps"  # live: never in a hash
    assert paths["model.d_model"].version_name() == "model.d_model"
    assert paths['evaluation.tasks["k40"]'].version_name() == 'evaluation.tasks["k40"]'


@dataclasses.dataclass(frozen=True)
class _Inner:
    lr: float = 1.0


@dataclasses.dataclass(frozen=True)
class _Clash:
    lr: float = 2.0
    opt: _Inner = group("a group whose field has its parent's name", default_factory=_Inner)


def test_two_versioned_fields_with_one_name_in_the_hash_are_refused():
    step = ExecutorStep(name="clash", fn=print, config=versioned_config(_Clash()))
    with pytest.raises(PlanError, match=r"config fields lr and opt.lr are both named 'lr' in the version"):
        plan_steps([step], "/p")


def test_a_group_hashes_like_the_flat_fields_it_holds():
    """The rule itself, on two small configs: the grouped one's hash is the flat one's."""

    @dataclasses.dataclass(frozen=True)
    class Flat:
        output_path: str
        lr: float = 1.0

    @dataclasses.dataclass(frozen=True)
    class Grouped:
        output_path: str
        opt: _Inner = group("an optimizer group", default_factory=_Inner)

    flat = ExecutorStep(name="s", fn=print, config=Flat(this_output_path(), versioned(0.5)))
    grouped = ExecutorStep(name="s", fn=print, config=versioned_config(Grouped(this_output_path(), _Inner(0.5))))
    assert plan_steps([flat], "/p").steps[0].hash == plan_steps([grouped], "/p").steps[0].hash


def test_a_ladder_rung_reaches_the_trainer_as_the_moeconfig_it_was_built_as():
    """Follow each rung of the tiny ladder: the MoEConfig ladder_rungs built goes into default_train,
    through the step's version and the executor's resolution, into the trainer's model, and back
    out of the run's config record, unchanged (no preset-and-differences round trip)."""
    from experiments.tiny_ladder import tiny_ladder
    from marin.training.trainer import model_config

    steps = tiny_ladder("reduced")
    plan = plan_steps([steps["fit"], steps["check"]], "/p")
    for rung in steps["rungs"]:
        ps = plan.planned(steps["trains"][rung.name])
        config = resolve_config(ps, plan)  # what the executor hands the step's function
        model = model_config(config)  # what the trainer builds
        assert type(model) is MoEConfig and model == rung.model, rung.name
        assert ps.config_leaves["model.d_model"] == rung.model.d_model  # versioned field by field
        assert train_config_from_record(json.loads(json.dumps(to_jsonable(config)))).model == rung.model


def test_the_lr_schedule_reads_either_spelling_of_a_record():
    """marin replan-lr and the health report read a run's schedule from its record, old or new."""
    from marin.training.schedule import schedule_from_config

    config = _grouped_like_the_flat_record()
    assert schedule_from_config(json.loads(FLAT_RECORD.read_text())) == config.lr_schedule()
    assert schedule_from_config(to_jsonable(config)) == config.lr_schedule()
