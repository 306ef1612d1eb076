"""Branching from a checkpoint (``init_from``): the early-cooldown side branch and continuing a run,
resharded onto the new run's pool; the source run untouched; the branch's version names its source."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from marin.models.config import get_preset
from marin.training import checkpoint as ckpt
from marin.training.checkpoint import CheckpointManager, read_pins
from marin.training.config import (
    AdamWConfig,
    CheckpointPolicy,
    InitFrom,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
)
from marin.training.metrics import read_metrics
from marin.training.schedule import lr_at
from marin.training.trainer import run_training


def _config(path, *, lr_replans=(), **kw) -> TrainConfig:
    # one layer: XLA drops the layer loop of a one-step scan, so each train step (two here: the source's
    # pool and local-cpu's mesh) compiles in about 2/3 of the 4-layer time; nothing here depends on depth
    base = dict(output_path=str(path), data=SyntheticDataConfig(vocab_size=512), model=get_preset("tiny", n_layers=1),
                pool="local-cpu-1", train_steps=4, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                optimizer=AdamWConfig(warmup_steps=1, lr_replans=lr_replans),
                checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None, keep_last=1, keep_every=2),
                telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0))
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "main"
    run_training(_config(path), use_ray=False)
    return path


def _snapshot(path):
    """Every file of a run but its pins (which other steps write, so its retention keeps their sources)."""
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and "pins" not in p.relative_to(path).parts}


def test_a_branch_with_the_data_position_continues_the_source_exactly(source, tmp_path):
    before = _snapshot(source)
    summary = run_training(_config(tmp_path / "branch", init_from=InitFrom(str(source), 2)), use_ray=False)
    assert summary["resumed_from"] == 2 and summary["final_step"] == 4
    src = read_metrics(str(source))
    branch = read_metrics(str(tmp_path / "branch"))
    assert [r["step"] for r in branch] == [3, 4]
    assert [r["loss"] for r in branch] == [r["loss"] for r in src[2:]]  # same state, data and LR: bitwise
    assert _snapshot(source) == before  # the main run is untouched
    # ... but for the pin on the branch's source checkpoint, which its retention now never deletes
    assert read_pins(str(source)) == {2: [f"branch {tmp_path / 'branch'}"]}
    mgr = CheckpointManager(str(source), _config(source).checkpoint)
    assert mgr.retention_plan()[2] == f"keep: pinned by branch {tmp_path / 'branch'}"


def test_the_early_cooldown_branch_decays_to_the_final_lr_over_its_own_horizon(source, tmp_path):
    cfg = _config(tmp_path / "cooldown", init_from=InitFrom(str(source), 2), lr_replans=((2, 3),))
    summary = run_training(cfg, use_ray=False)
    assert summary["final_step"] == 3
    [rec] = read_metrics(str(tmp_path / "cooldown"))
    # the re-planned decay pivots at the branch point (same LR there) and reaches the final LR at step 3
    assert rec["lr"] == lr_at(2, cfg.lr_schedule()) and rec["loss"] == read_metrics(str(source))[2]["loss"]
    assert lr_at(3, cfg.lr_schedule()) == pytest.approx(cfg.optimizer.peak_lr * cfg.optimizer.final_lr_fraction)
    assert ckpt.CheckpointManager(str(tmp_path / "cooldown"), cfg.checkpoint).committed_steps() == [3]


def test_weights_only_onto_another_pool(source, tmp_path):
    """Resharded onto local-cpu's (2, 4) mesh with fresh AdamW moments, from step 0 of its own schedule."""
    import jax

    from marin.parallel.mesh import make_mesh
    from marin.training.trainer import branch_state, model_config, state_shapes, state_shardings

    cfg_t = _config(tmp_path / "b", pool="local-cpu", init_from=InitFrom(str(source), 2, optimizer=False,
                                                                                   data_position=False))
    cfg = model_config(cfg_t)
    mesh = make_mesh(2, 4)
    shapes = state_shapes(cfg_t, cfg)
    state, start, tokens = branch_state(cfg_t, cfg, mesh, shapes, state_shardings(shapes, mesh, "fsdp"))
    assert start is None and tokens == 0
    two, _ = ckpt.read_checkpoint(str(source / "checkpoints" / "step-00000002"))
    assert np.asarray(state["params"]["embed"]).tobytes() == two["['params']['embed']"].tobytes()
    assert state["params"]["embed"].sharding.mesh.devices.shape == (2, 4)
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0]
    assert moments and all(not np.asarray(x).any() for x in moments)  # fresh AdamW moments: zeros
    summary = run_training(dataclasses.replace(cfg_t, train_steps=1), use_ray=False)
    assert summary["resumed_from"] is None and summary["final_step"] == 1


def test_a_missing_checkpoint_step_is_a_clear_error(source, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no committed checkpoint at step 3; committed: \[2, 4\]"):
        run_training(_config(tmp_path / "x", init_from=InitFrom(str(source), 3)), use_ray=False)


def test_the_branch_version_names_its_source_and_step():
    from experiments.defaults import branch_from, default_train
    from marin.execution import plan_steps

    def train(name, **kw):
        kw.setdefault("optimizer", AdamWConfig(warmup_steps=1))  # a warmup fits in the 4-step horizon
        return default_train(name, mixture=SyntheticDataConfig(vocab_size=512), model="tiny", pool="local-cpu-1",
                             train_steps=4, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                             telemetry=TelemetryConfig(wandb_project=None), **kw)

    def branch_hash(main, step=2, **kw):
        b = train("b", init_from=branch_from(main, step, **kw))
        plan = plan_steps([b], "/tmp/p")
        return plan.planned(b), plan

    main = train("main")
    planned, plan = branch_hash(main)
    assert planned.config_leaves["init_from.step"] == 2
    assert [d.name for d in planned.nonblocking_dependencies] == ["main"]  # a side branch of a live run
    h = planned.hash
    assert branch_hash(main, 4)[0].hash != h
    assert branch_hash(main, optimizer=False)[0].hash != h
    # the source's version is part of it
    assert branch_hash(train("main", optimizer=AdamWConfig(peak_lr=1e-3, warmup_steps=1)))[0].hash != h
    assert [d.name for d in branch_hash(main, wait_for_source=True)[0].dependencies] == ["main"]
    # without init_from nothing of it is in a training step's version (existing hashes stay)
    assert not any(k.startswith("init_from") for k in plan_steps([main], "/tmp/p").planned(main).config_leaves)


@pytest.fixture()
def fresh_experiment_modules(offline_k40):
    """Import experiment files offline and forget them afterwards (module-level data roots are read
    at import time; other tests import them under their own settings)."""
    import sys

    before = {k for k in sys.modules if k.startswith("experiments.")}
    yield
    for k in [k for k in sys.modules if k.startswith("experiments.") and k not in before]:
        del sys.modules[k]


def test_the_hero_declares_its_early_cooldown_branch(fresh_experiment_modules):
    from experiments import hero
    from marin.execution import plan_steps

    plan = plan_steps([hero.hero_early_cooldown], "/tmp/p")
    p = plan.planned(hero.hero_early_cooldown)
    assert p.config_leaves["init_from.step"] == hero.EARLY_COOLDOWN_AT_STEP
    assert hero.EARLY_COOLDOWN_AT_STEP % hero.HERO_TRAIN["checkpoint"].keep_every == 0  # the main run keeps it
    assert [d.name for d in p.nonblocking_dependencies] == ["hero/moe-535b-a23b"]
    cfg = hero.hero_early_cooldown.config
    assert cfg.optimizer.lr_replans == ((60_000, 66_600),)


def test_a_branch_is_versioned_by_the_configs_rule():
    """init_from follows TrainConfig's field metadata: its fields are leaves, its run a placeholder."""
    from experiments.defaults import branch_from, default_train
    from marin.execution import plan_steps
    from marin.execution.versioning import versioned_leaves

    main = default_train("main", mixture=SyntheticDataConfig(), model="tiny", pool="local-cpu-1",
                         telemetry=TelemetryConfig(wandb_project=None))
    b = default_train("b", mixture=SyntheticDataConfig(), model="tiny", pool="local-cpu-1",
                      telemetry=TelemetryConfig(wandb_project=None), init_from=branch_from(main, 2))
    leaves = set(plan_steps([b], "/tmp/p").planned(b).config_leaves)
    assert {"init_from.step", "init_from.optimizer", "init_from.data_position"} <= leaves
    assert leaves >= versioned_leaves(InitFrom, "init_from")
