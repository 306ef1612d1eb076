"""A training step's version names the model it trains, not just a preset name (planning only, no Ray)."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from experiments.defaults import default_health_report, default_train
from marin.execution import lease as leases
from marin.execution import plan_steps, resolve_config
from marin.execution import status as st
from marin.execution.versioning import rule
from marin.models import config as model_config
from marin.review.explain import explain
from marin.training.config import (
    AdamWConfig,
    CheckpointPolicy,
    ParallelismConfig,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
)


def _pipeline(**train_kwargs):
    kwargs = {"mixture": SyntheticDataConfig(), "model": "tiny-ep", "telemetry": TelemetryConfig(wandb_project=None),
              **train_kwargs}
    train = default_train("t/train", **kwargs)
    return train, default_health_report("t/health", train)


def _paths(prefix, **train_kwargs) -> dict[str, str]:
    train, health = _pipeline(**train_kwargs)
    plan = plan_steps([health], prefix)
    return {s.name: s.output_path for s in plan.steps}


def _tiny_ep(**fields) -> dict:
    """default_train's model: tiny-ep with these fields, named by its preset as a preset name is."""
    return {"model": model_config.get_preset("tiny-ep", **fields), "preset": "tiny-ep"}


def _edit_preset(monkeypatch, **changes):
    presets = dict(model_config.PRESETS)
    presets["tiny-ep"] = dataclasses.replace(presets["tiny-ep"], **changes)
    monkeypatch.setattr(model_config, "PRESETS", presets)


def test_resolved_model_fields_are_versioned_leaves(tmp_path):
    train, _ = _pipeline(**_tiny_ep(capacity_factor=2.0, dtype="bfloat16"), seq_len_phases=((0.0, 64), (0.5, 256)))
    plan = plan_steps([train], str(tmp_path))
    leaves = plan.steps[0].config_leaves
    # every field, but those added later while at their default (left out so earlier steps keep their hashes)
    every_field = {f"model.{f.name}" for f in dataclasses.fields(model_config.MoEConfig)
                   if rule(f)[0] != "added_later"}
    assert every_field <= set(leaves)
    assert leaves["model.n_layers"] == 4 and leaves["preset"] == "tiny-ep"
    assert leaves["model.capacity_factor"] == {"float": "2.0"} and leaves["model.dtype"] == "bfloat16"
    for name in ("beta1", "beta2", "adam_eps", "final_lr_fraction", "weight_decay"):
        assert name in leaves
    # the resolved config the trainer gets is a real MoEConfig with the overrides and the longest phase applied
    cfg = resolve_config(plan.steps[0], plan)
    assert isinstance(cfg, TrainConfig) and isinstance(cfg.model, model_config.MoEConfig)
    assert cfg.model == model_config.get_preset("tiny-ep", capacity_factor=2.0, dtype="bfloat16", max_seq_len=256)
    assert cfg.preset == "tiny-ep"


def test_editing_a_preset_field_moves_the_train_step_and_its_dependents(tmp_path, monkeypatch):
    before = _paths(str(tmp_path))
    _edit_preset(monkeypatch, n_layers=6)
    after = _paths(str(tmp_path))
    assert before["t/train"] != after["t/train"]
    assert before["t/health"] != after["t/health"]


@pytest.mark.parametrize("kwargs", [
    {"optimizer": AdamWConfig(beta1=0.8)}, {"optimizer": AdamWConfig(beta2=0.99)},
    {"optimizer": AdamWConfig(adam_eps=1e-6)}, {"optimizer": AdamWConfig(final_lr_fraction=0.1)},
    {"optimizer": AdamWConfig(weight_decay=0.0)}, {"optimizer": AdamWConfig(grad_clip=0.5)},
    {"optimizer": AdamWConfig(peak_lr=1e-3)}, {"optimizer": AdamWConfig(warmup_steps=3)},
    {"seed": 1}, {"train_steps": 50}, {"tokens_per_step": 8192}, {"seq_len_phases": ((0.0, 32),)},
    _tiny_ep(dtype="bfloat16"), {"model": "tiny"}, _tiny_ep(z_loss_weight=0.0), _tiny_ep(router_bias_update="sign"),
    _tiny_ep(router_bias_rate=0.5), _tiny_ep(capacity_factor=2.0), _tiny_ep(remat_policy="full"),
    _tiny_ep(attention_impl="blocked"), _tiny_ep(attention_block=64),
    {"mixture": SyntheticDataConfig(noise=0.1)},
])
def test_every_field_that_changes_the_math_moves_the_hash(tmp_path, kwargs):
    assert _paths(str(tmp_path), **kwargs)["t/train"] != _paths(str(tmp_path))["t/train"]


@pytest.mark.parametrize("kwargs", [
    {"pool": "local-cpu-ep8"}, {"optimizer": AdamWConfig(lr_replans=((50, 200),))},
    {"parallelism": ParallelismConfig(transport_switches=((0, "fixed"), (5, "dropless")))},
    {"checkpoint": CheckpointPolicy(every_steps=7)}, {"checkpoint": CheckpointPolicy(every_minutes=None)},
    {"checkpoint": CheckpointPolicy(keep_last=5)}, {"checkpoint": CheckpointPolicy(keep_every=10)},
    {"telemetry": TelemetryConfig(wandb_project="other")},
    {"telemetry": TelemetryConfig(wandb_project=None, log_every=5)},
    {"parallelism": ParallelismConfig(param_sharding="fsdp")},
])
def test_operator_settings_keep_the_output_path(tmp_path, kwargs):
    assert _paths(str(tmp_path), **kwargs)["t/train"] == _paths(str(tmp_path))["t/train"]


EXPERIMENT = textwrap.dedent("""
    from experiments.defaults import default_health_report, default_train
    from marin.execution import executor_main
    from marin.training.config import SyntheticDataConfig, TelemetryConfig

    train = default_train("t/train", mixture=SyntheticDataConfig(), model="tiny-ep",
                          telemetry=TelemetryConfig(wandb_project=None))
    executor_main(steps=[default_health_report("t/health", train)])
""")


def test_explain_names_the_preset_field_that_changed(tmp_path, monkeypatch):
    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT)
    prefix = str(tmp_path / "store")
    # a finished run of the 4-layer train step, recorded as the executor records it
    train, health = _pipeline()
    old = plan_steps([health], prefix).planned(train)
    lease = leases.try_acquire(old.output_path, "test", info={
        "name": old.name, "hash": old.hash, "version": old.version(), "output_path": old.output_path})
    st.write_status(old.output_path, st.StepStatus.SUCCESS, lease=lease)

    _edit_preset(monkeypatch, n_layers=6)
    rows = {r["name"]: r for r in explain(str(exp), prefix)}
    assert rows["t/train"]["would_run"]
    assert "versioned field model.n_layers changed: 4 -> 6" in rows["t/train"]["reasons"]
    assert rows["t/health"]["would_run"]


def test_a_preset_name_is_resolved_once_and_a_models_fields_are_kept():
    cfg = TrainConfig(output_path="x", data=SyntheticDataConfig(), model="tiny", seq_len_phases=((0.0, 512),))
    assert cfg.preset == "tiny"
    assert cfg.model == model_config.get_preset("tiny", max_seq_len=512)  # raised to the longest phase
    assert dataclasses.replace(cfg, seed=1).model == cfg.model
    two = TrainConfig(output_path="x", data=SyntheticDataConfig(), preset="tiny",
                      model=model_config.get_preset("tiny", n_layers=2, dtype="bfloat16"), seq_len_phases=((0.0, 512),))
    assert two.preset == "tiny"
    assert two.model == model_config.get_preset("tiny", n_layers=2, dtype="bfloat16", max_seq_len=512)
    assert dataclasses.replace(two, seed=1).model == two.model


def test_default_train_takes_train_config_fields_and_refuses_a_misspelt_one():
    step = default_train("t/train", mixture=SyntheticDataConfig(), optimizer=AdamWConfig(peak_lr=1e-3,
                                                                                          lr_replans=[(50, 150)]))
    # one spelling, live
    assert step.config.optimizer.peak_lr.value == 1e-3 and step.config.optimizer.lr_replans == ((50, 150),)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'peak_lrr'"):  # Python's own: names it
        default_train("t/train", mixture=SyntheticDataConfig(), peak_lrr=1e-3)
