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
from marin.models.config import get_preset
from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.metrics import MetricsWriter, read_metrics
from marin.training.trainer import run_training


def _config(path, **kw) -> TrainConfig:
    base = dict(output_path=str(path), data=SyntheticDataConfig(vocab_size=512), model=get_preset("tiny", n_layers=1),
                pool="local-cpu-1",
                train_steps=16, tokens_per_step=128, seq_len_phases=((0.0, 16),), optimizer=AdamWConfig(warmup_steps=1),
                checkpoint=CheckpointPolicy(every_steps=1000, every_minutes=None, keep_last=2),
                telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0, log_every=1))
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
    # botocore's own retries of a refused connection (~7 s per write here) sit under marin's limit and
    # only stretch the test: one botocore attempt per write, marin's retries are the claim
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
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



def _sharded_state(seed: int):
    """A state whose first leaf is sharded over 8 devices (8 chunk writes) plus a replicated leaf."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(rng.normal(size=(16, 4)).astype(np.float32), NamedSharding(mesh, P("x"))),
            "count": jax.device_put(np.asarray(seed, np.int32), NamedSharding(mesh, P()))}


def _same(a, b) -> bool:
    import jax
    import numpy as np

    return all(np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))


def _outage_during_chunk_writes(monkeypatch, s3, *, back_after_s: float | None) -> None:
    """Stop the store as the save opens its second array (the index is written, the first leaf's chunk
    writes are in flight); start it again ``back_after_s`` later (None: the test does)."""
    import threading

    from marin.training import checkpoint as ckpt

    real, calls = ckpt.save._array_spec, []

    def spec(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            s3.stop()
            if back_after_s is not None:
                threading.Timer(back_after_s, s3.start).start()
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt.save, "_array_spec", spec)


def test_a_checkpoint_save_rides_out_a_store_outage_during_its_chunk_writes(restartable_s3, monkeypatch, caplog):
    from marin.training.checkpoint import CheckpointManager, CheckpointPolicy

    monkeypatch.setenv("MARIN_STORAGE_RETRY_S", "60")
    policy = CheckpointPolicy(every_steps=1, keep_last=3)
    mgr = CheckpointManager("s3://outage/ckpt", policy)
    mgr.save(1, _sharded_state(1), {"data_step": 1}, blocking=True)
    _outage_during_chunk_writes(monkeypatch, restartable_s3, back_after_s=4.0)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="marin.execution.retry"):
        mgr.save(2, _sharded_state(2), {"data_step": 2}, blocking=True)
    assert time.monotonic() - t0 >= 4.0  # it waited for the store, and did not give up
    what = "write the chunks of s3://outage/ckpt/checkpoints/step-00000002 (process 0)"
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{what} failed (ValueError: ")]
    assert failed and "CURL error Could not connect to server" in failed[0], failed
    assert "attempt 1, retrying in 0.5s (giving up 60s after the first failure)" in failed[0]
    assert any(r.getMessage().startswith(f"{what} succeeded again after ") for r in caplog.records)
    fresh = CheckpointManager("s3://outage/ckpt", policy)
    assert fresh.committed_steps() == [1, 2]
    restored, meta = fresh.restore(2, template=_sharded_state(0))
    assert _same(restored, _sharded_state(2)) and meta["data_step"] == 2  # bit-identical


def test_a_store_outage_past_the_limit_fails_the_save_with_its_cause_and_keeps_the_previous(
        restartable_s3, monkeypatch):
    from marin.execution.failures import is_infrastructure_failure
    from marin.training.checkpoint import CheckpointManager, CheckpointPolicy, CheckpointWriteError, SavesFailing

    monkeypatch.setenv("MARIN_STORAGE_RETRY_S", "3")
    # one botocore attempt per write (as in test_an_outage_past_the_limit_fails_with_the_stores_error):
    # its own retries of the refused connection only stretch the best-effort ABORT write past the limit
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    policy = CheckpointPolicy(every_steps=1, keep_last=3, max_failed_saves=1)  # the first failure ends it
    mgr = CheckpointManager("s3://outage/short-ckpt", policy)
    mgr.save(1, _sharded_state(1), {"data_step": 1}, blocking=True)
    _outage_during_chunk_writes(monkeypatch, restartable_s3, back_after_s=None)
    t0 = time.monotonic()
    with pytest.raises(SavesFailing) as failing:
        mgr.save(2, _sharded_state(2), {"data_step": 2}, blocking=True)
    assert time.monotonic() - t0 < 60
    assert str(failing.value).startswith("1 permanent save in a row failed (checkpoint.max_failed_saves=1); the "
                                         "last, at step 2: saving checkpoint s3://outage/short-ckpt/"), failing.value
    e = failing.value.__cause__
    assert isinstance(e, CheckpointWriteError)
    msg = str(e)
    assert msg.startswith("saving checkpoint s3://outage/short-ckpt/checkpoints/step-00000002 failed on process 0: "
                          "write the chunks of s3://outage/short-ckpt/checkpoints/step-00000002 (process 0): the "
                          "store stayed unreachable for "), msg
    assert "CURL error Could not connect to server" in msg and msg.endswith(
        "; it was not committed and the previous checkpoint is intact"), msg
    assert isinstance(e.__cause__, StorageUnavailable)
    assert is_infrastructure_failure(failing.value)  # the executor retries the step from its last checkpoint
    restartable_s3.start()
    fresh = CheckpointManager("s3://outage/short-ckpt", policy)
    assert fresh.committed_steps() == [1]
    step, tree, _ = fresh.restore_latest(template=_sharded_state(0))
    assert step == 1 and _same(tree, _sharded_state(1))
