"""TrainConfig grouped by concept: the groups' own checks, a flat keyword of before refused, the hash
rule that kept every step's hash, the records, and a ladder rung's model followed from the builder
into the trainer."""

from __future__ import annotations

import dataclasses
import json

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
    GROUPS,
    AdamWConfig,
    CheckpointPolicy,
    ParallelismConfig,
    StallRule,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
    TrainEvalConfig,
    train_config_from_record,
)


def _every_field_set() -> TrainConfig:
    """A config that sets its fields and its groups' fields, most to a value other than their default."""
    from marin.data.mixture import MixtureConfig
    from marin.evaluation.sets import EvalSet
    from marin.training.config import InitFrom

    return TrainConfig(
        output_path="/runs/tiny-abc", data=MixtureConfig(stores=("/stores/a", "/stores/b"), validation_fraction=0.01),
        model=get_preset("tiny", n_layers=2, dtype="bfloat16", max_seq_len=128), preset="tiny", pool="local-cpu-1",
        seed=3, train_steps=40, tokens_per_step=2048, seq_len_phases=((0.0, 32), (0.5, 64)),
        init_from=InitFrom(run="/runs/source-123", step=20, optimizer=False),
        optimizer=AdamWConfig(peak_lr=2e-3, warmup_steps=4, final_lr_fraction=0.1, lr_replans=((20, 60),),
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


def test_a_grouped_record_round_trips():
    config = _every_field_set()
    record = json.loads(json.dumps(to_jsonable(config)))
    assert record["optimizer"]["peak_lr"] == 2e-3 and "peak_lr" not in record
    assert train_config_from_record(record) == config


def test_a_flat_keyword_of_before_is_a_plain_type_error():
    """The flat spellings of before TrainConfig was grouped (peak_lr=, checkpoint_every_steps=, ...)
    are unknown keywords: Python's own TypeError names the one given."""
    config = TrainConfig(output_path="x", data=SyntheticDataConfig())
    with pytest.raises(TypeError, match="unexpected keyword argument 'peak_lr'"):
        TrainConfig(output_path="x", data=SyntheticDataConfig(), peak_lr=1e-3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'warmup_steps'"):
        dataclasses.replace(config, warmup_steps=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'checkpoint_every_steps'"):
        default_train("t", mixture=SyntheticDataConfig(), checkpoint_every_steps=7)
    assert not hasattr(config, "peak_lr") and config.optimizer.peak_lr > 0


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
    (lambda: AdamWConfig(beta2=1.0), r"optimizer.beta2 must be in \[0, 1\)"),
    (lambda: AdamWConfig(peak_lr=0.0), r"optimizer.peak_lr must be > 0"),
    (lambda: ParallelismConfig(param_sharding="zero3"), r"unknown param_sharding 'zero3'"),
    (lambda: ParallelismConfig(remat_by_seq_len=((64, "most"),)), r"unknown remat policy 'most'"),
    (lambda: TrainEvalConfig(tasks={"k": "/t.jsonl"}), r"evaluation.every_steps=None turns off"),
    (lambda: TelemetryConfig(log_every=0), r"telemetry.log_every must be >= 1"),
    (lambda: CheckpointPolicy(every_minutes=0), r"every_minutes must be > 0"),
    (lambda: TrainConfig(output_path="x", data=SyntheticDataConfig(),
                         checkpoint=CheckpointPolicy(temp_every_minutes=5)),
     r"checkpoint.temp_every_minutes needs checkpoint.temp_path"),
])
def test_each_group_checks_its_own_fields(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def _hash_steps():
    """A source run and a branch of it that set every TrainConfig field, with in-training eval sets
    and a task from steps (placeholders inside the evaluation config)."""
    tok = default_tokenize("h/tok", "/corpus", "/tok.json")
    suite = default_eval_suite({"paloma": "/evals/*.jsonl"}, "/tok.json")
    task = default_domain_task("h/task", ("council", "infra", "web_code", "science"))
    every = dict(
        mixture=default_mixture([tok]), model=get_preset("tiny", n_layers=2, dtype="bfloat16"),
        preset="tiny", pool="local-cpu-1", seed=3, train_steps=40, tokens_per_step=2048,
        seq_len_phases=((0.0, 32), (0.5, 64)),
        optimizer=AdamWConfig(peak_lr=2e-3, warmup_steps=4, final_lr_fraction=0.1, lr_replans=((20, 60),),
                                  weight_decay=0.05, beta2=0.99, grad_clip=0.5),
        checkpoint=CheckpointPolicy(every_steps=10, every_minutes=None, keep_last=3, keep_every=20),
        stall=StallRule(timeout_s=900.0), telemetry=TelemetryConfig(log_every=5, wandb_project=None),
        evaluation=TrainEvalConfig(every_steps=10, sets=suite, held_out=False, tasks={"k40": task}, stride=16),
        parallelism=ParallelismConfig(microbatches=2, param_sharding="fsdp", transport_switches=((0, "fixed"),)),
        memory_check="off")
    src = default_train("h/src", **every)
    return src, default_train("h/branch", **every, init_from=branch_from(src, 20))


def test_grouping_moved_no_hash():
    """The hashes of these steps, pinned (the same code path as the pinned hashes of the shipped
    experiments, tests/experiments/pinned_step_hashes.json): a group's fields are named in the hash
    as the flat fields were (optimizer.peak_lr as peak_lr), so the grouping moved no hash."""
    src, branch = _hash_steps()
    hashes = {s.name: s.hash for s in plan_steps([src, branch], "/p").steps}
    # (moved when default_mixture's data order became without_replacement_v1: b03ca0197d / 7421e35810
    # before; and when in-training evaluation's dependencies were named by their path, evaluation.sets[0]
    # instead of eval_sets[0]: 1380123cb0 / ff2ae7c274 before)
    assert hashes["h/src"] == "bdf5ff75f6" and hashes["h/branch"] == "c14d6460f3"


def test_records_spell_the_group_and_the_version_names_the_flat_field():
    src, _ = _hash_steps()
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


def test_the_lr_schedule_reads_a_record():
    """marin replan-lr and the health report read a run's schedule from its record."""
    from marin.training.schedule import schedule_from_config

    config = _every_field_set()
    assert schedule_from_config(json.loads(json.dumps(to_jsonable(config)))) == config.lr_schedule()
