"""Optimizers as components of a run: the tagged union TrainConfig.optimizer (parsing, records,
versions), the compiled-program keys, the planner's optimizer state leaf by leaf against the real
state, MuonH's checkpoint resume (bitwise), a branch that switches optimizer, and the hero's step
with MuonH lowered for CUDA."""

from __future__ import annotations

import dataclasses
import json
import shutil
from typing import Any, ClassVar, Literal

import draccus
import jax
import numpy as np
import pytest

from marin.cli import main
from marin.execution import ExecutorStep, plan_steps
from marin.execution.jsonable import to_jsonable
from marin.models.config import get_preset
from marin.pools import get_pool
from marin.training import checkpoint as ckpt
from marin.training.config import (
    GROUPS,
    InitFrom,
    ParallelismConfig,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
    train_config_from_record,
)
from marin.training.lowering import abstract_mesh, abstract_state, forbidden_ops, lower_train_step
from marin.training.optimizers import (
    OPTIMIZERS,
    AdamWConfig,
    MuonHConfig,
    OptimizerBase,
    optimizer_from,
    optimizer_type,
    register_optimizer,
)
from marin.training.planning import checkpoint_bytes_per_host, memory_plan
from marin.training.trainer import IncompatibleCheckpoint, branch_state, model_config, run_training, state_shardings


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{"output_path": "", "data": SyntheticDataConfig(),
                          "telemetry": TelemetryConfig(wandb_project=None), **kw})


# ---- the union --------------------------------------------------------------------------------------
def test_the_union_reads_from_dicts_records_and_the_command_line():
    assert optimizer_from({"peak_lr": 1e-3}) == AdamWConfig(peak_lr=1e-3)  # no kind: AdamW, as recorded before
    assert optimizer_from({"kind": "muonh", "adam_lr": 1e-3}) == MuonHConfig(adam_lr=1e-3)
    with pytest.raises(ValueError, match=r"unknown optimizer kind 'sgd'; choose from \['adamw', 'muonh'\]"):
        optimizer_from({"kind": "sgd"})
    config = _config(optimizer={"kind": "muonh", "peak_lr": 0.01, "warmup_steps": 2, "lr_replans": [[5, 20]]},
                     train_steps=10)
    assert config.optimizer == MuonHConfig(peak_lr=0.01, warmup_steps=2, lr_replans=((5, 20),))
    assert config.total_steps == 20
    # a run's record reads back as the config it was (one generic reader, led by the union's members)
    for opt in (MuonHConfig(peak_lr=0.01, grad_clip=None), AdamWConfig(beta2=0.99)):
        config = _config(optimizer=opt)
        assert train_config_from_record(to_jsonable(config)) == config

    @dataclasses.dataclass
    class Cli:
        optimizer: AdamWConfig | MuonHConfig = dataclasses.field(default_factory=AdamWConfig)

    assert draccus.parse(Cli, args=["--optimizer.kind", "muonh", "--optimizer.adam_lr", "0.001"]).optimizer == \
        MuonHConfig(adam_lr=0.001)
    assert draccus.decode(Cli, {"optimizer": {"beta2": 0.9}}).optimizer == AdamWConfig(beta2=0.9)


@dataclasses.dataclass(frozen=True)
class SGDMConfig(OptimizerBase):
    """SGD with momentum: an optimizer added the way a user adds one (registered by the test)."""

    momentum: float = 0.9
    kind: Literal["sgdm"] = "sgdm"

    STATE_BYTES: ClassVar[dict[str, int]] = {"sgdm": 4}  # one float32 momentum buffer

    def leaf_group(self, key: str, shape: tuple[int, ...]) -> str:
        return "sgdm"

    def transformation(self) -> Any:
        import optax

        inner = optax.trace(decay=self.momentum)

        def update(grads, state, params=None, *, lr, **extra):
            direction, state = inner.update(grads, state, params)
            return jax.tree.map(lambda u: -lr * u, direction), state

        return optax.GradientTransformationExtraArgs(inner.init, update)


@pytest.fixture
def unregistered():
    """The registry as it was after the test (SGDMConfig registered for one test only)."""
    yield
    OPTIMIZERS.pop("sgdm", None)


def test_registering_an_optimizer_is_all_the_config_its_groups_record_and_cli_need(unregistered, capsys):
    with pytest.raises(ValueError, match=r"^optimizer SGDMConfig is not registered: call "
                                         r"register_optimizer\(SGDMConfig\) in its module$"):
        _config(optimizer=SGDMConfig(momentum=0.5))
    register_optimizer(SGDMConfig)
    with pytest.raises(ValueError, match="optimizer kind 'sgdm' is taken by"):
        register_optimizer(dataclasses.make_dataclass("Other", [("kind", str, dataclasses.field(default="sgdm"))],
                                                      bases=(OptimizerBase,), frozen=True))
    # the config and its group: an instance or a dict (a parsed command line, a record) by its kind
    config = _config(optimizer=SGDMConfig(momentum=0.5))
    assert isinstance(config.optimizer, GROUPS["optimizer"])
    assert _config(optimizer={"kind": "sgdm", "momentum": 0.5}) == config
    assert train_config_from_record(to_jsonable(config)) == config
    step = plan_steps([ExecutorStep("t", print, config)], "/p").steps[0]  # named as the parent's own, as AdamW's
    assert step.config_leaves["momentum"] == {"float": "0.5"} and step.config_leaves["kind"] == "sgdm"

    @dataclasses.dataclass
    class Cli:
        optimizer: optimizer_type() = dataclasses.field(default_factory=AdamWConfig)  # type: ignore[valid-type]

    assert draccus.parse(Cli, args=["--optimizer.kind", "sgdm", "--optimizer.momentum", "0.5"]).optimizer == \
        SGDMConfig(momentum=0.5)
    # marin plan offers it and plans its state from its STATE_BYTES: one buffer where AdamW keeps two
    planned = {}
    for name in ("adamw", "sgdm"):
        assert main(["plan", "tiny", "--pool", "local-cpu", "--optimizer", name, "--json"]) == 0
        planned[name] = json.loads(capsys.readouterr().out)["bytes_per_device"]["optimizer_state"]
    assert planned["sgdm"] * 2 == planned["adamw"] > 0


def test_adamw_keeps_its_version_and_muonh_has_its_own():
    from experiments.defaults import default_train

    def step(opt, name="t"):
        return plan_steps([default_train(name, mixture=SyntheticDataConfig(), optimizer=opt, memory_check="off")],
                          "/p").steps[-1]

    adamw = step(AdamWConfig())
    assert "kind" not in adamw.config_leaves  # AdamW's tag is never in a version: the old hashes hold
    assert step(AdamWConfig(lr_replans=((50, 150),))).hash == adamw.hash  # live
    muonh = step(MuonHConfig())
    assert muonh.hash != adamw.hash and muonh.config_leaves["kind"] is not None
    assert step(MuonHConfig(adam_lr=1e-3)).hash != muonh.hash


def test_compiled_programs_are_keyed_by_the_config_less_the_host_schedule():
    a = AdamWConfig(peak_lr=1e-3, warmup_steps=5, lr_replans=((10, 40),))
    assert a.program_key() == AdamWConfig()  # AdamW's step is fed the LR: nothing of the schedule is compiled
    assert AdamWConfig(beta2=0.9).program_key() != AdamWConfig().program_key()
    m = MuonHConfig(warmup_steps=7, lr_replans=((10, 40),))
    assert m.program_key() == MuonHConfig()
    # MuonH's Adam group runs at adam_lr / peak_lr times the fed LR: both are compiled in
    assert MuonHConfig(peak_lr=0.01).program_key() != MuonHConfig().program_key()
    assert MuonHConfig(adam_lr=1e-3).program_key() != MuonHConfig().program_key()
    hash(m.program_key())  # a cache key


# ---- the planner ------------------------------------------------------------------------------------
@pytest.mark.parametrize("param_sharding", ["replicated", "fsdp"])
def test_the_planned_muonh_state_is_the_real_per_device_shards(param_sharding):
    config = _config(model="d2048", pool="gb200-11racks", tokens_per_step=704 * 4096, seq_len_phases=((0.0, 4096),),
                     optimizer=MuonHConfig(), parallelism=ParallelismConfig(param_sharding=param_sharding))
    cfg = model_config(config)
    pool = get_pool("gb200-11racks")
    state, _ = abstract_state(config, cfg, abstract_mesh(*pool.mesh))

    def shard_bytes(tree):
        return sum(int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize for s in jax.tree.leaves(tree))

    mem = memory_plan(cfg, pool, config.tokens_per_step, 4096, 1, "fixed", param_sharding, MuonHConfig())
    assert abs(mem["optimizer_state"] - shard_bytes(state["opt_state"])) <= 64  # + Adam's step count
    adamw = memory_plan(cfg, pool, config.tokens_per_step, 4096, 1, "fixed", param_sharding)
    assert mem["optimizer_state"] < adamw["optimizer_state"]  # one buffer, not two, for the matrices
    assert adamw["optimizer_workspace"] == 0 < mem["optimizer_workspace"]
    assert sum(checkpoint_bytes_per_host(cfg, pool, param_sharding, MuonHConfig())) < sum(
        checkpoint_bytes_per_host(cfg, pool, param_sharding))


@pytest.mark.slow
@pytest.mark.parametrize("param_sharding,pool,transport,tokens", [("replicated", "local-cpu-1", "local", 2048),
                                                                  ("fsdp", "local-cpu", "fixed", 4096)])
def test_the_planned_muonh_step_is_within_15_percent_of_xla(param_sharding, pool, transport, tokens):
    """As the planner's AdamW check (tests/training/test_planning.py): the total against XLA's own
    memory analysis of the compiled step with MuonH (0.88 and 0.94 of it here, as AdamW's)."""
    from marin.parallel.mesh import make_mesh

    config = _config(model=get_preset("tiny-ep", n_layers=2), pool=pool, tokens_per_step=tokens,
                     seq_len_phases=((0.0, 64),), optimizer=MuonHConfig(),
                     parallelism=ParallelismConfig(param_sharding=param_sharding))
    cfg, p = model_config(config), get_pool(pool)
    lowered = lower_train_step(config, cfg, p.mesh, transport, batch_size=tokens // 64, seq_len=64, platform="cpu",
                               mesh=make_mesh(*p.mesh))
    ma = lowered.compile().memory_analysis()
    xla = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    planned = memory_plan(cfg, p, tokens, 64, 1, transport, param_sharding, MuonHConfig())["total"]
    assert abs(planned - xla) <= 0.15 * xla, (planned, xla)


def test_the_hero_with_muonh_fits_every_phase(capsys):
    """``marin plan hero --optimizer muonh``: every sequence-length phase on both transports fits a
    GB200 (the hero's main run trains with MuonH and is declared with the memory check that refuses one
    that does not; AdamW is its variant step)."""
    from experiments.hero import hero, hero_adamw

    assert isinstance(hero.config.optimizer, MuonHConfig) and isinstance(hero_adamw.config.optimizer, AdamWConfig)
    assert main(["plan", "hero", "--pool", "gb200-11racks", "--json", "--optimizer", "muonh"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["optimizer"] == "muonh" and p["fits"] and len(p["phases"]) == 8 and all(ph["fits"] for ph in p["phases"])
    assert p["bytes_per_device"]["optimizer_workspace"] > 0


# ---- checkpoints ------------------------------------------------------------------------------------
def _run_config(path, **kw) -> TrainConfig:
    base = dict(output_path=str(path), data=SyntheticDataConfig(vocab_size=512), model=get_preset("tiny", n_layers=1),
                pool="local-cpu-1",
                train_steps=4, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                optimizer=MuonHConfig(peak_lr=0.02, adam_lr=3e-3, warmup_steps=1),
                checkpoint=ckpt.CheckpointPolicy(every_steps=2, every_minutes=None, keep_last=2),
                telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0))
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def muonh_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("muonh") / "run"
    run_training(_run_config(path), use_ray=False)
    return path


def test_muonh_checkpoints_hold_its_state_and_resume_bitwise(muonh_run, tmp_path):
    final, _ = ckpt.read_checkpoint(str(muonh_run / "checkpoints" / "step-00000004"))
    # leaves by path: one momentum buffer per MuonH matrix, Adam's two moments for the rest, Adam's count
    assert int(final["['opt_state'].count"]) == 4
    assert {"['opt_state'].momentum['blocks']['wq']", "['opt_state'].momentum['blocks']['expert_up']",
            "['opt_state'].mu['embed']", "['opt_state'].nu['lm_head']"} <= set(final)
    assert "['opt_state'].mu['blocks']['wq']" not in final and "['opt_state'].momentum['embed']" not in final
    # the same run interrupted after step 2 resumes from its checkpoint to the same state, bit for bit
    resumed = tmp_path / "run"
    shutil.copytree(muonh_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")
    summary = run_training(_run_config(resumed), use_ray=False)
    assert summary["resumed_from"] == 2 and summary["final_step"] == 4
    again, _ = ckpt.read_checkpoint(str(resumed / "checkpoints" / "step-00000004"))
    assert set(again) == set(final)
    for key in final:
        np.testing.assert_array_equal(again[key], final[key], err_msg=key)


def test_a_branch_switches_optimizer_only_with_a_fresh_state(muonh_run, tmp_path):
    from marin.parallel.mesh import make_mesh
    from marin.training.trainer import state_shapes

    mesh = make_mesh(1, 1)

    def branch(optimizer: bool):
        config = _run_config(tmp_path / "b", optimizer=AdamWConfig(warmup_steps=1),  # within the 4-step horizon
                             init_from=InitFrom(str(muonh_run), 2, optimizer=optimizer))
        cfg = model_config(config)
        shapes = state_shapes(config, cfg)
        return branch_state(config, cfg, mesh, shapes, state_shardings(shapes, mesh))

    with pytest.raises(IncompatibleCheckpoint, match=r"holds muonh state but this run trains with adamw; switching "
                                                     r"optimizers needs a fresh optimizer state"):
        branch(True)
    state, start, _ = branch(False)  # the weights and the data position, with fresh AdamW moments
    source, _ = ckpt.read_checkpoint(str(muonh_run / "checkpoints" / "step-00000002"))
    assert start == 2
    np.testing.assert_array_equal(np.asarray(state["params"]["embed"]), source["['params']['embed']"])
    assert not np.asarray(state["opt_state"][1].mu["embed"]).any()


# ---- CUDA ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_hero_step_with_muonh_lowers_for_cuda():
    """The hero (2 layers) on its 11 x 64 mesh, fsdp: MuonH's Newton-Schulz and hyperball steps are in
    the GPU program, nothing CPU-only."""
    config = _config(model=get_preset("hero", n_layers=2), seq_len_phases=((0.0, 256),),
                     parallelism=ParallelismConfig(param_sharding="fsdp"), optimizer=MuonHConfig())
    text = lower_train_step(config, model_config(config), (11, 64), "fixed", batch_size=704, seq_len=256).as_text()
    assert forbidden_ops(text) == []
    assert "stablehlo.while" in text  # the layer map of the Newton-Schulz iterations
