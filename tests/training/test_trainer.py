"""The trainer in this process (no Ray): learning, telemetry, NaN guard, resume bit for bit."""

import dataclasses
import glob
import json
import os

import numpy as np
import pytest

from marin.models.config import get_preset
from marin.training.checkpoint import CheckpointManager, latest_checkpoint, read_checkpoint
from marin.training.config import (
    AdamWConfig,
    CheckpointPolicy,
    ParallelismConfig,
    SyntheticDataConfig,
    TelemetryConfig,
    TrainConfig,
)
from marin.training.metrics import METRIC_KEYS, read_metrics
from marin.training.trainer import TrainingDiverged, run_training, synthetic_batch


def _config(tmp_path, name: str, *, optimizer=None, checkpoint=None, telemetry=None, **kw) -> TrainConfig:
    """A tiny run; ``optimizer``, ``checkpoint``, ``telemetry``: fields changed from this run's values."""
    base = dict(
        output_path=str(tmp_path / name),
        data=SyntheticDataConfig(vocab_size=512),
        # one layer: XLA drops the layer loop of a one-step scan, so each train step compiles in
        # about 2/3 of the 4-layer time; nothing here depends on the depth
        model=get_preset("tiny", n_layers=1),
        pool="local-cpu-1",
        train_steps=8,
        tokens_per_step=512,
        seq_len_phases=((0.0, 16), (0.5, 32)),
        optimizer=AdamWConfig(**{"warmup_steps": 2, **(optimizer or {})}),
        checkpoint=CheckpointPolicy(**{"every_steps": 3, "every_minutes": None, **(checkpoint or {})}),
        telemetry=TelemetryConfig(**{"wandb_project": None, "progress_every_s": 0.0, **(telemetry or {})}),
    )
    base.update(kw)
    return TrainConfig(**base)


def test_synthetic_batch_is_a_pure_function():
    cfg = SyntheticDataConfig(vocab_size=64, seed=3)
    a, b = synthetic_batch(cfg, 5, 4, 8), synthetic_batch(cfg, 5, 4, 8)
    assert a["tokens"].shape == (4, 9) and a["tokens"].dtype == np.int32
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not np.array_equal(a["tokens"], synthetic_batch(cfg, 6, 4, 8)["tokens"])


def test_train_metrics_wandb_and_final_checkpoint(tmp_path):
    cfg = _config(tmp_path, "run", telemetry={"wandb_project": "marin-test"}, train_steps=10,
                  optimizer={"peak_lr": 1e-2})
    summary = run_training(cfg, use_ray=False)
    assert summary["final_step"] == 10
    records = read_metrics(cfg.output_path)
    assert [r["step"] for r in records] == list(range(1, 11))
    for r in records:
        assert set(METRIC_KEYS) <= set(r), set(METRIC_KEYS) - set(r)
    # seq-len schedule at constant tokens per step; tokens counted exactly
    assert [(r["seq_len"], r["batch_size"]) for r in records] == [(16, 32)] * 5 + [(32, 16)] * 5
    assert records[-1]["tokens"] == 10 * 512
    # the loss clearly falls on the learnable synthetic stream
    assert np.mean([r["loss"] for r in records[-3:]]) < records[0]["loss"] - 0.5
    assert records[0]["lr"] == pytest.approx(1e-2 / 2)
    # checkpoints: every 3 steps, keep last 2, plus the final one
    assert CheckpointManager(cfg.output_path, cfg.checkpoint).committed_steps() == [9, 10]
    # W&B offline run written into the step directory
    assert glob.glob(os.path.join(cfg.output_path, "wandb", "offline-run-*", "*.wandb"))
    summary_file = json.load(open(os.path.join(cfg.output_path, "train_summary.json")))
    assert summary_file["final_step"] == 10
    # drop fraction and throughput per seq-len phase
    assert [(p["seq_len"], p["first_step"], p["last_step"]) for p in summary_file["phases"]] == [
        (16, 1, 5),
        (32, 6, 10),
    ]
    # evaluation finds the model by path
    assert latest_checkpoint(cfg.output_path).endswith("checkpoints/step-00000010")


def test_nan_guard_stops_and_keeps_last_good_checkpoint(tmp_path):
    cfg = _config(tmp_path, "nan", checkpoint={"every_steps": 1}, train_steps=6,
                  optimizer={"warmup_steps": 0, "peak_lr": 1e30})
    with pytest.raises(TrainingDiverged, match=r"non-finite training signal at step \d+") as err:
        run_training(cfg, use_ray=False)
    failed_step = int(str(err.value).split("at step ")[1].split(":")[0])
    steps = CheckpointManager(cfg.output_path, cfg.checkpoint).committed_steps()
    # nothing was saved for the failing step or after it; what is there is complete and finite
    assert steps and max(steps) == failed_step - 1
    assert str(max(steps)) in str(err.value) or f"step-{max(steps):08d}" in str(err.value)
    flat, _ = read_checkpoint(f"{cfg.output_path}/checkpoints/step-{max(steps):08d}")
    assert all(np.isfinite(v).all() for v in flat.values() if v.dtype.kind == "f")


def test_crash_and_resume_is_bitwise_identical(tmp_path, stop_after_checkpoint):
    """A run that dies after its step-6 checkpoint and is rerun ends exactly where a clean run ends."""
    clean = _config(tmp_path, "clean")
    run_training(clean, use_ray=False)

    crashy = _config(tmp_path, "crashy")
    stop_after_checkpoint(crashy, 6)
    summary = run_training(crashy, use_ray=False)
    assert summary["resumed_from"] == 6

    a, _ = read_checkpoint(f"{clean.output_path}/checkpoints/step-00000008")
    b, _ = read_checkpoint(f"{crashy.output_path}/checkpoints/step-00000008")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k
    # metrics of the resumed run have one record per step, no duplicates of replayed steps
    assert [r["step"] for r in read_metrics(crashy.output_path)] == list(range(1, 9))
    assert [r["loss"] for r in read_metrics(crashy.output_path)] == [r["loss"] for r in read_metrics(clean.output_path)]


def test_replan_horizon_on_resume(tmp_path, stop_after_checkpoint):
    """Shorten the horizon of a resumed run: LR continuous at the switch, ends at 5% of peak."""
    cfg = _config(tmp_path, "replan", train_steps=8, checkpoint={"every_steps": 4}, optimizer={"peak_lr": 1e-2})
    stop_after_checkpoint(cfg, 4)
    replanned = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, lr_replans=((4, 6),)))
    summary = run_training(replanned, use_ray=False)
    assert summary["final_step"] == 6
    lrs = [r["lr"] for r in read_metrics(cfg.output_path)]
    assert len(lrs) == 6
    assert lrs[-1] == pytest.approx(0.05 * 1e-2 + (lrs[4] - 0.05 * 1e-2) / 2)
    assert lrs[4] > lrs[5]


def test_bf16_compute_keeps_fp32_master_weights(tmp_path):
    cfg = _config(tmp_path, "bf16", model=get_preset("tiny", n_layers=1, dtype="bfloat16"), train_steps=3,
                  seq_len_phases=((0.0, 16),))
    run_training(cfg, use_ray=False)
    records = read_metrics(cfg.output_path)
    assert all(np.isfinite(r["loss"]) for r in records)
    flat, meta = read_checkpoint(f"{cfg.output_path}/checkpoints/step-00000003")
    params = {k: v for k, v in flat.items() if k.startswith("['params']")}
    assert params and all(v.dtype == np.float32 for v in params.values())
    assert meta["config"]["model"]["dtype"] == "bfloat16"  # the model as trained, bf16 compute


def test_a_run_hot_switches_its_transport_and_extends_its_sequences(tmp_path):
    """The quickstart's schedules in miniature (its end-to-end test is in the slow set): EP over 8 fake
    devices, the fixed-buffer transport then dropless, 16-token sequences then 32 at half the batch, in
    one run that never restarts: one record per step and the same tokens in every step."""
    cfg = _config(tmp_path, "switch", model=get_preset("tiny-ep", n_layers=1), pool="local-cpu", train_steps=4,
                  tokens_per_step=256, seq_len_phases=((0.0, 16), (0.5, 32)),
                  parallelism=ParallelismConfig(transport_switches=((0, "fixed"), (2, "dropless"))),
                  checkpoint={"every_steps": 100})
    summary = run_training(cfg, use_ray=False)
    assert summary["final_step"] == 4 and summary["resumed_from"] is None
    records = read_metrics(cfg.output_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["transport"] for r in records] == ["fixed", "fixed", "dropless", "dropless"]
    assert [(r["seq_len"], r["batch_size"]) for r in records] == [(16, 16)] * 2 + [(32, 8)] * 2
    assert [r["tokens"] for r in records] == [256, 512, 768, 1024]
