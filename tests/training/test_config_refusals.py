"""Every check a dry run can make, it makes, while the experiment file is read: each numeric field of
TrainConfig, of its groups and its model, of the data configs (synthetic, mixture) and of the evaluation configs
(in-training evaluation, its eval sets), given a value no run can use (0, negative, NaN, infinity,
the wrong type), and the schedules, horizons and branches built from them, is refused in one line
naming the field and the experiment file's line, before any step is planned or any pool starts.

The table below is the specification: every numeric field of those configs must have a row (a field
added without one fails here), and each row's bad values follow from its range."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marin.data.mixture import MixtureConfig, MixtureStage
from marin.evaluation.sets import EvalSet
from marin.execution.errors import file_mistake_line
from marin.models.config import MoEConfig
from marin.pools.stall import StallRule
from marin.training.checkpoint.manager import CheckpointPolicy
from marin.training.config import (
    Cutover,
    InitFrom,
    ParallelismConfig,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
    TrainEvalConfig,
)
from marin.training.optimizers import AdamWConfig, MuonHConfig

REPO = Path(__file__).resolve().parents[2]

SPEC: dict[type, dict[str, str | None]] = {
    TrainConfig: {"seed": ">= 0", "train_steps": "> 0", "tokens_per_step": "> 0"},
    AdamWConfig: {"peak_lr": "> 0", "warmup_steps": ">= 0", "final_lr_fraction": "[0, 1]", "weight_decay": ">= 0",
                  "beta1": "[0, 1)", "beta2": "[0, 1)", "adam_eps": "> 0", "grad_clip": "> 0"},
    MuonHConfig: {"peak_lr": "> 0", "warmup_steps": ">= 0", "final_lr_fraction": "[0, 1]", "adam_lr": "> 0",
                  "momentum": "[0, 1)", "nesterov": None, "newton_schulz_steps": ">= 1", "muon_eps": "> 0",
                  "beta1": "[0, 1)", "beta2": "[0, 1)", "adam_eps": "> 0", "grad_clip": "> 0"},
    CheckpointPolicy: {"every_steps": "> 0", "every_minutes": "> 0", "keep_last": ">= 1", "keep_every": "> 0",
                       "temp_every_minutes": "> 0", "max_failed_saves": ">= 1", "max_minutes_without_commit": "> 0",
                       "preemption_grace_s": ">= 0"},
    StallRule: {"timeout_s": "> 0", "startup_s": "> 0", "factor": "> 0", "floor_s": "> 0"},
    TelemetryConfig: {"log_every": ">= 1", "progress_every_s": ">= 0"},
    ParallelismConfig: {"microbatches": ">= 1"},
    TrainEvalConfig: {"every_steps": "> 0", "held_out": None, "stride": "> 0"},
    InitFrom: {"step": "> 0", "optimizer": None, "data_position": None},
    Cutover: {"step": "> 0", "forced": None},
    SyntheticDataConfig: {"vocab_size": ">= 1", "seed": ">= 0", "n_rules": ">= 1", "noise": "[0, 1]"},
    MixtureConfig: {"seed": ">= 0", "validation_fraction": "[0, 1]", "validation_min_documents": ">= 0",
                    "validation_max_documents": ">= 0"},
    MixtureStage: {"start_step": ">= 0", "start_fraction": "[0, 1]"},
    EvalSet: {"held_out": None, "validation_fraction": "[0, 1]", "validation_min_documents": ">= 0",
              "validation_max_documents": ">= 0", "max_documents": ">= 1"},
    MoEConfig: {"vocab_size": ">= 1", "d_model": ">= 1", "n_layers": ">= 1", "n_heads": ">= 1", "n_kv_heads": ">= 1",
                "n_kv_heads_global": ">= 1", "head_dim": ">= 1", "max_seq_len": ">= 1", "sliding_window": ">= 1",
                "global_every": ">= 1", "rope_theta": "> 0", "attention_block": ">= 1", "context_parallel": ">= 1",
                "latent_dim": ">= 1", "n_experts": ">= 1", "top_k": ">= 1", "expert_width": ">= 1",
                "expert_width_multiple": ">= 1", "n_shared_experts": ">= 0", "shared_width": ">= 1",
                "normalize_combine": None, "z_loss_weight": ">= 0", "capacity_factor": "> 0", "expert_chunks": ">= 1",
                "router_bias_rate": "> 0", "router_hist_bins": ">= 1", "tie_embeddings": None, "norm_eps": "> 0"},
}
"""Config class -> each numeric field's range (None: a bool)."""

# How the experiment file spells each config's fields in the message, and the declaration that holds it
# (FIELD and BAD are the field and its bad value; every line builds one training step).
TRAIN = "default_train('t', mixture=SyntheticDataConfig(), model='tiny', train_steps=20, memory_check='off'"
DECLARED: dict[type, tuple[str, str]] = {
    TrainConfig: ("", TRAIN.replace("train_steps=20, ", "") + ", optimizer=AdamWConfig(warmup_steps=0), "
                      "**{'train_steps': 20, FIELD: BAD})"),
    AdamWConfig: ("optimizer.", TRAIN + ", optimizer=AdamWConfig(**{'warmup_steps': 0, FIELD: BAD}))"),
    MuonHConfig: ("optimizer.", TRAIN + ", optimizer=MuonHConfig(**{'warmup_steps': 0, FIELD: BAD}))"),
    CheckpointPolicy: ("checkpoint.", TRAIN + ", checkpoint=CheckpointPolicy(**{FIELD: BAD}))"),
    StallRule: ("stall.", TRAIN + ", stall=StallRule(**{FIELD: BAD}))"),
    TelemetryConfig: ("telemetry.", TRAIN + ", telemetry=TelemetryConfig(**{FIELD: BAD}))"),
    ParallelismConfig: ("parallelism.", TRAIN + ", parallelism=ParallelismConfig(**{FIELD: BAD}))"),
    TrainEvalConfig: ("evaluation.", TRAIN + ", evaluation=TrainEvalConfig(**{FIELD: BAD}))"),
    InitFrom: ("init_from.", TRAIN + ", init_from=InitFrom(**{'run': '/runs/source', 'step': 10, FIELD: BAD}))"),
    Cutover: ("Cutover.", TRAIN + ", cutovers=(Cutover(**{'step': 10, 'gate': '/g', 'candidate': 'c', FIELD: BAD}),))"),
    SyntheticDataConfig: ("SyntheticDataConfig.", TRAIN.replace("SyntheticDataConfig()",
                                                                "SyntheticDataConfig(**{FIELD: BAD})") + ")"),
    MixtureConfig: ("mixture.", TRAIN.replace("SyntheticDataConfig()", "MixtureConfig(**{'stores': ('/s',), "
                                              "FIELD: BAD})") + ")"),
    MixtureStage: ("MixtureStage.", TRAIN.replace("SyntheticDataConfig()", "MixtureConfig(stores=('/s',), "
                   "stages=(MixtureStage(**{'start_step': 5, 'start_fraction': None, FIELD: BAD}),))") + ")"),
    EvalSet: ("EvalSet.", TRAIN + ", evaluation=TrainEvalConfig(every_steps=5, sets=(EvalSet(**{'name': 'v', "
              "'store': '/s', FIELD: BAD}),)))"),
    MoEConfig: ("model.", TRAIN.replace("model='tiny'", "model=get_preset('tiny', **{FIELD: BAD})") + ")"),
}


def _bad_values(rule: str | None, kind: str) -> list:
    """Values no run can use in a field of ``kind`` (int, float, bool) with range ``rule``: below or above
    the range, NaN, infinity, the wrong type."""
    if kind == "bool":
        return ["yes", 1, None]
    low = {"> 0": [0, -1], ">= 0": [-1], ">= 1": [0, -3], "[0, 1]": [-0.5, 1.5], "[0, 1)": [1.0, -0.1]}[rule]
    if kind == "int":
        return [*low, 2.5, math.nan, "8"]
    return [*low, math.nan, math.inf, -math.inf, "1e-3"]


def _numeric(cls: type) -> dict[str, str]:
    """name -> "int" | "float" | "bool" for the fields of ``cls`` whose annotation is one (optionally | None)."""
    out = {}
    for f in dataclasses.fields(cls):
        kinds = [p.strip() for p in str(f.type).split("|") if p.strip() != "None"]
        if kinds in (["int"], ["float"], ["bool"]):
            out[f.name] = kinds[0]
    return out


CASES = [pytest.param(cls, name, bad, id=f"{cls.__name__}.{name}={bad!r}")
         for cls, fields in SPEC.items() for name, rule in fields.items()
         for bad in _bad_values(rule, _numeric(cls)[name])]

NAMESPACE = "from experiments.defaults import default_train, branch_from\n" \
            "from marin.data.mixture import MixtureConfig, MixtureStage\n" \
            "from marin.evaluation.sets import EvalSet\n" \
            "from marin.models.config import get_preset\n" \
            "from marin.pools.stall import StallRule\n" \
            "from marin.training.checkpoint.manager import CheckpointPolicy\n" \
            "from marin.training.config import Cutover, InitFrom, ParallelismConfig, SyntheticDataConfig, " \
            "TelemetryConfig, TrainEvalConfig\n" \
            "from marin.training.optimizers import AdamWConfig, MuonHConfig\n"


def _refusal(tmp_path: Path, declaration: str, **names) -> tuple[str, int]:
    """The line a user sees for the experiment file whose last line is ``declaration`` (read as
    ``python exp.py`` or ``marin run exp.py`` reads it), and that line's number."""
    path = tmp_path / "exp.py"
    source = NAMESPACE + declaration + "\n"
    path.write_text(source)
    namespace = dict(names)
    try:
        exec(compile(source, str(path), "exec"), namespace)
    except Exception as e:  # noqa: BLE001 - whatever it is, the user must see one line
        line = file_mistake_line(e, e.__traceback__, str(path))
        assert line is not None, f"a traceback, not one line: {type(e).__name__}: {e}"
        return line, source.count("\n")
    raise AssertionError(f"accepted: {declaration} with {names}")


def test_the_table_names_every_numeric_field():
    for cls, fields in SPEC.items():
        assert set(fields) == set(_numeric(cls)), f"{cls.__name__}: give each numeric field a row"
    assert len(CASES) == 448  # docs/contributing.md quotes this count


@pytest.mark.parametrize(("cls", "name", "bad"), CASES)
def test_a_bad_value_is_one_line_naming_the_field_and_the_file_line(tmp_path, cls, name, bad):
    prefix, declaration = DECLARED[cls]
    line, lineno = _refusal(tmp_path, declaration, FIELD=name, BAD=bad)
    assert "\n" not in line and line.startswith(f"marin: error: {prefix}{name} must be "), line
    assert line.endswith(f"exp.py:{lineno})"), line


SCHEDULES = [
    ("seq_len_phases=((0.5, 64),)",
     "seq_len_phases ((0.5, 64),): the first phase must start at 0 (the run's first step), got 0.5"),
    ("seq_len_phases=((0.6, 64), (0.2, 128))",
     "seq_len_phases ((0.6, 64), (0.2, 128)): phase start fractions must be strictly increasing, got [0.6, 0.2]"),
    ("seq_len_phases=((0.0, 64), (1.5, 128))",
     "seq_len_phases ((0.0, 64), (1.5, 128)): a phase must start at a fraction of the run in [0, 1), got 1.5"),
    ("seq_len_phases=((0.0, 64), (float('nan'), 128))",
     "seq_len_phases ((0.0, 64), (nan, 128)): a phase must start at a fraction of the run in [0, 1), got nan"),
    ("seq_len_phases=()", "seq_len_phases (): a schedule needs at least one phase, the first starting at 0"),
    ("seq_len_phases=((0.0, 100),)", "seq_len_phases ((0.0, 100),): tokens_per_step 4096 is not a multiple of "
                                     "seq_len 100"),
    ("seq_len_phases=64", "seq_len_phases must be a tuple of (float, int) pairs, got 64"),
    ("seq_len_phases=((0.0, 'long'),)", "seq_len_phases must be a tuple of (float, int) pairs, got ((0.0, 'long'),)"),
    ("train_steps=5", "optimizer.warmup_steps (10) must be at most train_steps (5): the warmup is part of the horizon"),
    ("optimizer=AdamWConfig(warmup_steps=2, lr_replans=((10, 5),))",
     "optimizer.lr_replans ((10, 5),): replan Replan(at_step=10, total_steps=5): the new horizon must lie after the "
     "switch step"),
    ("optimizer=AdamWConfig(warmup_steps=2, lr_replans=((10, 30), (5, 40)))",
     "optimizer.lr_replans ((10, 30), (5, 40)): replans must be in step order; Replan(at_step=5, total_steps=40) "
     "comes after step 10"),
    ("optimizer=AdamWConfig(lr_replans=((10, 'later'),))",
     "optimizer.lr_replans must be (at_step, new_total_steps) pairs of whole numbers, got ((10, 'later'),)"),
    ("parallelism=ParallelismConfig(transport_switches=((5, 'fixed'),))",
     "parallelism.transport_switches ((5, 'fixed'),): the transport schedule must name the transport at step 0"),
    ("parallelism=ParallelismConfig(transport_switches=((0, 'fixed'), (9, 'ragged'), (4, 'dropless')))",
     "parallelism.transport_switches ((0, 'fixed'), (9, 'ragged'), (4, 'dropless')): switch steps must be strictly "
     "increasing, got [0, 9, 4]"),
    ("parallelism=ParallelismConfig(transport_switches=((0, 'fixed'), (9, 'teleport')))",
     "parallelism.transport_switches: unknown transport 'teleport'; choose from local, fixed, dropless, ragged, "
     "ragged_capacity"),
    ("parallelism=ParallelismConfig(context_parallel_by_seq_len=((64, 0),))",
     "parallelism.context_parallel_by_seq_len[0] degree must be >= 1 (a whole number), got 0"),
    ("parallelism=ParallelismConfig(remat_by_seq_len=((-64, 'full'),))",
     "parallelism.remat_by_seq_len[0] sequence length must be >= 1 (a whole number), got -64"),
    ("checkpoint=CheckpointPolicy(pinned_steps=(10, -2))",
     "checkpoint.pinned_steps[1] must be > 0 (a whole number), got -2"),
    ("mixture=MixtureConfig(stores=('/s',), domain_weights={'council': float('inf')})",
     "mixture.domain_weights['council'] must be >= 0 (a finite number), got inf"),
    ("optimizer='muonh'", "optimizer must be an optimizer config, got the name 'muonh': write "
                          "optimizer=MuonHConfig(...) with its learning rates"),
    ("optimizer=3e-4",
     "optimizer must be an optimizer config (AdamWConfig(...) or MuonHConfig(...)), got float 0.0003"),
]


@pytest.mark.parametrize(("change", "refusal"), SCHEDULES, ids=[c for c, _ in SCHEDULES])
def test_a_schedule_or_horizon_no_run_can_follow_is_one_line(tmp_path, change, refusal):
    declaration = TRAIN.replace("mixture=SyntheticDataConfig(), ", "").replace(
        "train_steps=20, ", "") + f", {'' if 'mixture=' in change else 'mixture=SyntheticDataConfig(), '}" + (
        change if "train_steps=" in change else f"train_steps=20, {change}") + ")"
    line, lineno = _refusal(tmp_path, declaration)
    assert line == f"marin: error: {refusal} (at {tmp_path / 'exp.py'}:{lineno})"


BRANCH = """
source = default_train('t/source', mixture=SyntheticDataConfig(), model='tiny', train_steps=20, memory_check='off',
                       optimizer=MuonHConfig(warmup_steps=2))
branch = default_train('t/branch', mixture=SyntheticDataConfig(), model='tiny', train_steps=20, memory_check='off',
                       optimizer=AdamWConfig(warmup_steps=2), init_from=branch_from(source, 10, optimizer=TAKE))
if __name__ == '__main__':
    from marin.execution import executor_main
    executor_main(steps=[branch])
"""


def test_a_branch_that_takes_another_optimizers_state_is_refused_by_the_dry_run(tmp_path):
    """It used to be listed [run] by the dry run and refused only after the pool started."""
    exp = tmp_path / "exp.py"
    exp.write_text(NAMESPACE + "TAKE = True\n" + BRANCH)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(exp), "--prefix", str(tmp_path / "p"), "--dry_run", "true"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == [
        "marin: error: init_from: t/source trains with muonh but this run with adamw, and a branch that takes the "
        "optimizer state needs the same optimizer: branch_from(..., optimizer=False) starts a fresh one "
        "(at exp.py:13)"]
    assert not (tmp_path / "p").exists()
    # a fresh optimizer state is fine: the branch takes only the weights
    exp.write_text(NAMESPACE + "TAKE = False\n" + BRANCH)
    r = subprocess.run([sys.executable, str(exp), "--prefix", str(tmp_path / "p"), "--dry_run", "true"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180)
    assert r.returncode == 0 and "2 of 2 steps would run" in r.stdout, r.stderr


def test_the_first_phase_not_at_zero_is_refused_by_the_dry_run_naming_the_field(tmp_path):
    """It used to pass the dry run and fail 18 s after the pool started, naming no field."""
    exp = tmp_path / "exp.py"
    exp.write_text(NAMESPACE + "train = " + TRAIN + ", seq_len_phases=((0.5, 64),))\n"
                   "if __name__ == '__main__':\n    from marin.execution import executor_main\n"
                   "    executor_main(steps=[train])\n")
    r = subprocess.run([sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix", str(tmp_path / "p"),
                        "--dry_run", "true"], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=180)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == ["marin: error: seq_len_phases ((0.5, 64),): the first phase must start at 0 (the "
                                     "run's first step), got 0.5 (at exp.py:9)"]
    assert not (tmp_path / "p").exists()
