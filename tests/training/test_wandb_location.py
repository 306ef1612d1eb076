"""W&B offline files of a training step live under the step directory on every backend: on an object
store they are staged on the host and copied up at every checkpoint and at the end, never left in the
worker's working directory."""

from __future__ import annotations

import fsspec

from marin.models.config import get_preset
from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.trainer import run_training


def test_wandb_offline_files_of_an_s3_step_land_in_its_step_directory(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the worker happens to run
    out = f"{s3_bucket}/run/train-0123456789"
    config = TrainConfig(output_path=out, data=SyntheticDataConfig(vocab_size=512),
                         model=get_preset("tiny", n_layers=1), pool="local-cpu-1",
                         train_steps=4, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                         optimizer=AdamWConfig(warmup_steps=1),
                         checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None),
                         telemetry=TelemetryConfig(wandb_project="marin-test", progress_every_s=1e9))
    run_training(config, use_ray=False)
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    runs = fs.glob(f"{out}/wandb/offline-run-*/*.wandb")
    assert len(runs) == 1, fs.find(out)
    assert fs.size(runs[0]) > 0
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory (no wandb-local/)
