"""A remat policy per sequence-length phase: the trainer compiles each phase with its own policy,
the memory planner plans it so, and the run computes what it computes without the override."""

from __future__ import annotations

import dataclasses
import json

import pytest

from marin.models.config import get_preset
from marin.training import trainer
from marin.training.config import (
    AdamWConfig,
    CheckpointPolicy,
    ParallelismConfig,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
    model_at,
)
from marin.training.planning import train_config_plans
from marin.training.trainer import run_training


def _losses(path) -> list[float]:
    records = [json.loads(line) for line in open(path / "metrics.jsonl")]
    return [r["loss"] for r in records if "loss" in r and r.get("kind", "train") == "train"]


def _config(out, remat_by_seq_len=()) -> TrainConfig:
    return TrainConfig(output_path=str(out), data=SyntheticDataConfig(vocab_size=512),
                       model=get_preset("tiny", n_layers=1), pool="local-cpu-1", train_steps=6, tokens_per_step=256,
                       seq_len_phases=((0.0, 16), (0.5, 32)),
                       optimizer=AdamWConfig(warmup_steps=1),
                       checkpoint=CheckpointPolicy(every_steps=100, every_minutes=None),
                       telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0),
                       parallelism=ParallelismConfig(remat_by_seq_len=remat_by_seq_len))


def test_model_at_overrides_only_the_named_phase():
    cfg = _config("x", remat_by_seq_len=((32, "full"),))
    assert model_at(cfg, cfg.model, 32).remat_policy == "full"
    assert model_at(cfg, cfg.model, 16) is cfg.model
    with pytest.raises(ValueError, match=r"remat_by_seq_len: unknown remat policy 'most'; choose from"):
        _config("x", remat_by_seq_len=((32, "most"),))


@pytest.mark.slow  # 26 s end to end; cores: the phase override and planner tests beside it
def test_a_phase_recomputing_every_layer_trains_the_same_run(tmp_path):
    plain = _config(tmp_path / "plain")
    remat = _config(tmp_path / "remat", remat_by_seq_len=((32, "full"),))
    run_training(plain, use_ray=False)
    before = set(trainer._STEP_CACHE)
    run_training(remat, use_ray=False)
    # the MoEConfig each step was compiled for (the key: the optimizer's program key, then the model)
    new = [key[1] for key in set(trainer._STEP_CACHE) - before]
    assert [c.remat_policy for c in new] == ["full"]  # only the 32-token phase needed a new program
    a, b = _losses(tmp_path / "plain"), _losses(tmp_path / "remat")
    assert len(a) == len(b) == 6
    assert b == pytest.approx(a, rel=1e-5)


def test_the_planner_plans_each_phase_with_its_policy():
    """The hero's 65K phase (one sequence per device) fits a GB200 only when it recomputes every layer."""
    hero = get_preset("hero")
    base = dict(output_path="", data=None, model=hero, preset="hero", pool="gb200-11racks",
                tokens_per_step=46_137_344, seq_len_phases=((0.0, 4096), (0.95, 65536)))
    par = ParallelismConfig(transport_switches=((0, "fixed"),), param_sharding="fsdp")
    without = {p["seq_len"]: p for p in train_config_plans(TrainConfig(**base, parallelism=par))}
    full = dataclasses.replace(par, remat_by_seq_len=((65536, "full"),))
    with_full = {p["seq_len"]: p for p in train_config_plans(TrainConfig(**base, parallelism=full))}
    assert without[65536]["remat_policy"] == "dots" and not without[65536]["fits"]
    assert with_full[65536]["remat_policy"] == "full" and with_full[65536]["fits"]
    assert with_full[4096]["remat_policy"] == "dots" and with_full[4096]["fits"]
    assert with_full[4096]["bytes_per_device"] == without[4096]["bytes_per_device"]
