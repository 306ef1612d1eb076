"""A run's config makes the round trip: stored as the trainer stores it, read back by the one
generic reader, equal to what was trained, field by field (and a field added later is covered by
the same reader without a change to it)."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

import numpy as np
import pytest

from marin.data.mixture import MixtureConfig, MixtureStage
from marin.data.order import WITH_REPLACEMENT
from marin.evaluation.sets import EvalSet
from marin.execution.jsonable import ConfigRecordError, from_jsonable, mask_secrets
from marin.execution.step import versioned
from marin.models.config import get_preset
from marin.training.checkpoint import write_checkpoint
from marin.training.config import (
    AdamWConfig,
    CheckpointPolicy,
    Cutover,
    InitFrom,
    ParallelismConfig,
    StallRule,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
    TrainEvalConfig,
    train_config_from_record,
)
from marin.training.run import Run


def every_field_mixture() -> MixtureConfig:
    return MixtureConfig(
        stores=("/stores/web-1a2b", "/stores/code-3c4d"), domain_weights={"web": 2.0, "code": 1.0},
        quality_weights={"hq": 1.5, "lq": 0.5}, domain_quality_weights={"web": {"hq": 3.0}},
        stages=(MixtureStage(start_fraction=0.3, domain_weights={"code": 2.0}),
                MixtureStage(start_step=500, quality_weights={"hq": 2.0})),
        seed=3, validation_fraction=0.02, validation_min_documents=2, validation_max_documents=50,
        tokenizer="/tokenizers/k40/tokenizer.json", order=WITH_REPLACEMENT)


def every_field_train_config() -> TrainConfig:
    model = get_preset("tiny", dtype="bfloat16", max_seq_len=128)
    return TrainConfig(
        output_path="/runs/train-0123456789", data=every_field_mixture(), model=model, pool="local-cpu-1", seed=7,
        train_steps=250, tokens_per_step=8192, seq_len_phases=((0.0, 64), (0.5, 128)), preset="tiny",
        optimizer=AdamWConfig(peak_lr=1e-3, warmup_steps=5, final_lr_fraction=0.1, lr_replans=((100, 300),),
                              weight_decay=0.05, beta1=0.8, beta2=0.99, adam_eps=1e-6, grad_clip=0.5),
        checkpoint=CheckpointPolicy(every_steps=50, every_minutes=15.0, keep_last=3, keep_every=100,
                                    temp_every_minutes=5.0, temp_path="/fast/tmp", preemption_grace_s=30.0),
        stall=StallRule(timeout_s=900.0, startup_s=1800.0),
        evaluation=TrainEvalConfig(
            every_steps=25, held_out=False, tasks={"choices": "/tasks/choices.jsonl"}, stride=32,
            sets=(EvalSet("val/web", "/stores/val-web", held_out=True, validation_fraction=0.5,
                          validation_min_documents=3, validation_max_documents=9, max_documents=7),)),
        telemetry=TelemetryConfig(log_every=5, wandb_project=None, run_name="round-trip", progress_every_s=1.0),
        parallelism=ParallelismConfig(microbatches=2, param_sharding="fsdp", remat_by_seq_len=((128, "full"),),
                                      context_parallel_by_seq_len=((128, 2),),
                                      transport_switches=((0, "fixed"), (50, "ragged_capacity")),
                                      grouped_impl="ragged_dot"),
        init_from=InitFrom("/runs/source-9876543210", step=40, optimizer=False, data_position=False),
        cutovers=(Cutover(50, "/gates/ragged-0a1b2c3d4e", "ragged", forced=True),))


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _fields_at_default(value: Any, path: str = "") -> list[str]:
    """Field paths of ``value`` (TrainConfig, its nested groups, MixtureConfig) still at their default."""
    out = []
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if v == _default_of(f):
            out.append(f"{path}{f.name}")
        nested = dataclasses.is_dataclass(v) and (type(v).__module__ == TrainConfig.__module__ or
                                                  isinstance(v, MixtureConfig))
        if nested:
            out += _fields_at_default(v, f"{path}{f.name}.")
    return out


def test_the_test_config_sets_every_field_to_a_value_other_than_its_default():
    assert _fields_at_default(every_field_train_config()) == []
    assert _fields_at_default(every_field_mixture()) == []


def test_every_train_config_field_reads_back_from_a_checkpoint_record(tmp_path):
    config = every_field_train_config()
    run_dir = str(tmp_path / "train-0123456789")
    # stored as the trainer stores it: the masked JSON rendering in the checkpoint's metadata
    write_checkpoint(f"{run_dir}/checkpoints/step-00000010", {"w": np.zeros(3, np.float32)},
                     {"tokens": 10, "config": mask_secrets(config)}, step=10)
    run = Run(run_dir)
    assert run.committed_steps == [10] and run.record()["model"]["d_model"] == config.model.d_model
    back = run.config()
    for f in dataclasses.fields(TrainConfig):  # each field named on failure, then the whole
        assert getattr(back, f.name) == getattr(config, f.name), f.name
    assert back == config


def test_mixture_config_reads_back_through_json():
    mixture = every_field_mixture()
    assert from_jsonable(MixtureConfig, json.loads(json.dumps(mask_secrets(mixture)))) == mixture


def test_synthetic_data_and_a_preset_name_read_back():
    config = TrainConfig(output_path="/runs/x", data=SyntheticDataConfig(vocab_size=256, seed=2), model="tiny",
                         pool="local-cpu-1", seq_len_phases=((0.0, 16),))
    back = train_config_from_record(json.loads(json.dumps(mask_secrets(config))))
    assert back == config and isinstance(back.data, SyntheticDataConfig)
    # an older record holds the preset name where today's holds the resolved model
    old = {**mask_secrets(config), "model": "tiny"}
    assert train_config_from_record(old).model == config.model


class Color(enum.Enum):
    RED = "r"
    BLUE = "b"


@dataclasses.dataclass(frozen=True)
class Inner:
    scale: float = 1.0
    color: Color = Color.RED


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner = Inner()
    maybe: Inner | None = None
    pairs: tuple[tuple[int, str], ...] = ()
    by_step: dict[int, float] = dataclasses.field(default_factory=dict)
    tags: frozenset[str] = frozenset()
    either: int | str = 0


def test_the_reader_handles_nesting_optionals_tuples_enums_keys_and_versioned_values():
    value = Outer("a", Inner(float("inf"), Color.BLUE), Inner(0.5), ((1, "x"), (2, "y")), {10: 0.5},
                  frozenset({"p", "q"}), "latest")
    assert from_jsonable(Outer, json.loads(json.dumps(mask_secrets(value)))) == value
    # a declared config (VersionedValue wrappers, as an experiment file builds it) reads as its values
    declared = Outer(versioned("a"), inner=Inner(versioned(2.0)), either=versioned(3))
    assert from_jsonable(Outer, declared) == Outer("a", Inner(2.0), either=3)
    assert from_jsonable(Outer, {"name": "a", "inner": {"color": "BLUE"}}).inner.color is Color.BLUE
    assert from_jsonable(Outer, {"name": "a", "inner": {"color": "b"}}).inner.color is Color.BLUE


def test_a_record_that_does_not_read_says_which_field():
    with pytest.raises(ConfigRecordError, match=r"field inner\.scale: expected float, got 'fast'"):
        from_jsonable(Outer, {"name": "a", "inner": {"scale": "fast"}})
    with pytest.raises(ConfigRecordError, match=r"field name: missing from the record"):
        from_jsonable(Outer, {})
    with pytest.raises(ConfigRecordError, match=r"Outer has no field 'colour'"):
        from_jsonable(Outer, {"name": "a", "colour": "red"})
    assert from_jsonable(Outer, {"name": "a", "colour": "red"}, ignore_unknown=True) == Outer("a")
    with pytest.raises(ConfigRecordError, match=r"field pairs\[0\]: expected 2 items, got 3"):
        from_jsonable(Outer, {"name": "a", "pairs": [[1, "x", 2]]})
