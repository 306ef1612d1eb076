"""Training on an object store through a real outage: a local S3 server (``restartable_s3``, from
tests/conftest.py) stopped mid-run and started again on the same port. The run keeps training while
the store is down, its metrics land in order and once, and an outage longer than the retry limit
fails with the store's own error."""

from __future__ import annotations

import json
import time

import fsspec
import pytest

from marin.execution.retry import StorageUnavailable
from marin.training.config import SyntheticDataConfig, TrainConfig
from marin.training.metrics import MetricsWriter, read_metrics
from marin.training.trainer import run_training


def _config(path, **kw) -> TrainConfig:
    base = dict(output_path=str(path), data=SyntheticDataConfig(vocab_size=512), model="tiny", pool="local-cpu-1",
                train_steps=16, tokens_per_step=128, seq_len_phases=((0.0, 16),), warmup_steps=1,
                checkpoint_every_steps=1000, checkpoint_every_minutes=None, keep_last_checkpoints=2,
                wandb_project=None, progress_every_s=0.0, log_every=1)
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow  # about 40 s: s3fs spends ~7 s of its own retries on each write attempt while the store is down
def test_training_rides_out_a_store_outage_and_logs_every_step_once_in_order(restartable_s3, monkeypatch):
    monkeypatch.setenv("MARIN_STORAGE_RETRY_S", "120")
    logged_while_down: list[int] = []
    real_log = MetricsWriter.log

    def log(self, record):  # the outage, placed by step: the store goes away after step 4, back after step 10
        real_log(self, record)
        if record.get("kind", "train") != "train":
            return
        if restartable_s3.server is None:
            logged_while_down.append(record["step"])
        if record["step"] == 4:
            restartable_s3.stop()
        elif record["step"] == 10:
            restartable_s3.start()

    monkeypatch.setattr(MetricsWriter, "log", log)
    summary = run_training(_config("s3://outage/run"), use_ray=False)
    assert summary["final_step"] == 16
    assert logged_while_down == [5, 6, 7, 8, 9, 10]  # training went on while the store was down
    records = read_metrics("s3://outage/run")
    assert [r["step"] for r in records] == list(range(1, 17))  # in order, none lost, none twice
    assert len({r["loss"] for r in records}) == 16  # sixteen distinct steps, not one repeated
    assert fsspec.filesystem("s3").exists("s3://outage/run/train_summary.json")


def test_an_outage_past_the_limit_fails_with_the_stores_error(restartable_s3, monkeypatch):
    monkeypatch.setenv("MARIN_STORAGE_RETRY_S", "3")
    writer = MetricsWriter("s3://outage/short")
    writer.log({"step": 1, "loss": 1.0})
    restartable_s3.stop()
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailable) as e:
        for step in range(2, 10_000):
            writer.log({"step": step, "loss": 1.0})
            time.sleep(0.05)
    assert time.monotonic() - t0 < 60
    msg = str(e.value)
    assert msg.startswith("write s3://outage/short/metrics.jsonl: the store stayed unreachable for ")
    assert "last error: EndpointConnectionError: Could not connect to the endpoint URL" in msg
    restartable_s3.start()
    assert [json.loads(line)["step"] for line in fsspec.open("s3://outage/short/metrics.jsonl", "r").open()] == [1]

