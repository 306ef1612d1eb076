"""A secret in a training config never reaches the run's files: metrics, W&B run files, checkpoints."""

from __future__ import annotations

import dataclasses
import glob
import os
import time

from marin.models.config import get_preset
from marin.training.checkpoint import latest_checkpoint, read_metadata
from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.trainer import run_training

SECRET = "hf_QpZxYwVuTsRqPoNmLkJiHgFeDcBa1234"


@dataclasses.dataclass(frozen=True)
class _AuthenticatedData(SyntheticDataConfig):
    """A data config that carries a credential, as a reader of a private bucket would."""

    hf_token: str = SECRET


def test_secret_named_field_is_masked_in_every_file_the_run_writes(tmp_path):
    out = tmp_path / "run"
    cfg = TrainConfig(output_path=str(out), data=_AuthenticatedData(vocab_size=512),
                      model=get_preset("tiny", n_layers=1), pool="local-cpu-1",
                      train_steps=2, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                      optimizer=AdamWConfig(warmup_steps=1),
                      checkpoint=CheckpointPolicy(every_steps=1, every_minutes=None),
                      telemetry=TelemetryConfig(wandb_project="marin-test", progress_every_s=0.0))
    run_training(cfg, use_ray=False)
    # W&B's offline run file holds the run config as JSON inside its records. W&B's own service
    # process writes it and may still be flushing when finish() returns on a loaded machine: wait.
    [run_file] = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + 60
    while b'"hf_token":' not in open(run_file, "rb").read() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b'"hf_token":"***"' in open(run_file, "rb").read()

    leaked = []
    for path in glob.glob(str(out / "**" / "*"), recursive=True):
        if os.path.isfile(path) and SECRET.encode() in open(path, "rb").read():
            leaked.append(os.path.relpath(path, out))
    assert not leaked, f"secret written to {leaked}"
    # the config is still recorded, with the field masked
    assert read_metadata(latest_checkpoint(str(out)))["config"]["data"]["hf_token"] == "***"
    assert (out / "metrics.jsonl").exists()
