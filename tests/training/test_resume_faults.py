"""Resuming a training step over damaged or foreign checkpoints (real JAX training, in this process)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from marin.models.config import get_preset
from marin.training.checkpoint import CheckpointManager
from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.metrics import read_metrics
from marin.training.trainer import IncompatibleCheckpoint, run_training


def _config(path, **kw) -> TrainConfig:
    # one model and data for every test: the compiled step (memoised per process) and the fresh
    # state's program are shared; one layer (XLA drops a one-step scan's loop: faster compiles)
    base = dict(output_path=str(path), data=SyntheticDataConfig(vocab_size=64),
                model=get_preset("tiny", vocab_size=64, n_layers=1), pool="local-cpu-1",
                train_steps=4, tokens_per_step=128, seq_len_phases=((0.0, 16),), optimizer=AdamWConfig(warmup_steps=1),
                checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None, keep_last=2),
                telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0))
    return TrainConfig(**{**base, **kw})


def _failing_allowed(config: TrainConfig, n: int) -> TrainConfig:
    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, max_failed_saves=n))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "done"
    run_training(_config(path), use_ray=False)
    return path


def test_truncated_latest_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    chunks = [p for p in (run / "checkpoints" / "step-00000004" / "arrays").rglob("*")
              if p.is_file() and p.name != "zarr.json"]
    big = max(chunks, key=lambda p: p.stat().st_size)
    big.write_bytes(big.read_bytes()[:1000])  # kill -9 while the file was being copied
    (run / "train_summary.json").unlink()

    with caplog.at_level("WARNING"):
        summary = run_training(_config(run), use_ray=False)
    assert summary["resumed_from"] == 2 and summary["final_step"] == 4
    assert "checkpoint at step 4 does not verify" in caplog.text
    assert [p.name for p in (run / "checkpoints").iterdir() if ".corrupt-" in p.name]
    assert CheckpointManager(str(run), _config(run).checkpoint).committed_steps() == [2, 4]
    # steps 3 and 4 were trained again from step 2's state: one metrics record per step, same losses
    again = read_metrics(str(run))
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert [r["loss"] for r in again] == [r["loss"] for r in read_metrics(str(finished_run))]


def test_resuming_a_different_model_names_the_mismatching_parameters(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with pytest.raises(IncompatibleCheckpoint) as err:
        run_training(_config(run, train_steps=6, model=get_preset("tiny", vocab_size=64, n_layers=4)), use_ray=False)
    msg = str(err.value)
    assert msg.startswith(f"checkpoint {run}/checkpoints/step-00000004 does not match the model being trained")
    assert "['params']['blocks']" in msg and "checkpoint float32[1, " in msg and "model wants float32[4, " in msg


def test_a_failed_save_costs_a_save_point_and_training_goes_on(tmp_path, monkeypatch, caplog):
    """Storage refusing the step-4 save (ENOSPC when the part record is written, after the chunks):
    one line names the checkpoint and the cause, training goes on, step 6 commits, and the half-written
    step 4 is never committed (the next save's retention removes it). The metrics count the failure."""
    import errno

    from marin.training import checkpoint as ckpt

    real_commit = ckpt.save._commit

    def full_disk(fs, path, data):
        if "/step-00000004/" in path:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_commit(fs, path, data)

    monkeypatch.setattr(ckpt.save, "_commit", full_disk)
    run = tmp_path / "run"
    with caplog.at_level("WARNING", logger="marin.training.checkpoint.manager"):
        summary = run_training(_config(run, train_steps=6), use_ray=False)
    assert summary["final_step"] == 6 and summary["checkpoint"].endswith("step-00000006")
    (line,) = [r.getMessage() for r in caplog.records if "checkpoint save at step" in r.getMessage()]
    assert "\n" not in line and line.startswith("checkpoint save at step 4 failed (1 of 3 in a row allowed): ")
    assert "step-00000004 failed on process 0: [Errno 28] No space left on device" in line
    assert "training goes on and the next save point tries again (newest committed: " in line
    mgr = CheckpointManager(str(run), _config(run).checkpoint)
    assert mgr.committed_steps() == [2, 6] and not (run / "checkpoints" / "step-00000004").exists()
    steps = [r for r in read_metrics(str(run)) if r.get("kind", "train") == "train"]
    assert [r["step"] for r in steps] == list(range(1, 7))  # every step once
    counted = [r.get("checkpoint_failed_saves", 0) for r in steps]  # from when the background save ended
    assert counted[:4] == [0, 0, 0, 0] and counted == sorted(counted) and set(counted) <= {0, 1}
    assert summary["checkpoint_failed_saves"] == 1


def test_saves_that_keep_failing_end_the_attempt_as_an_infrastructure_failure(tmp_path, monkeypatch):
    """checkpoint.max_failed_saves in a row (here 2: steps 4 and 6) ends the attempt with one line that
    names the limit, the last failure and the checkpoint the retry resumes from."""
    import errno

    from marin.execution.failures import is_infrastructure_failure
    from marin.training import checkpoint as ckpt

    real_commit = ckpt.save._commit

    def full_disk(fs, path, data):
        if "/step-00000004/" in path or "/step-00000006/" in path:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_commit(fs, path, data)

    monkeypatch.setattr(ckpt.save, "_commit", full_disk)
    run = tmp_path / "run"
    with pytest.raises(ckpt.SavesFailing) as err:
        run_training(_failing_allowed(_config(run, train_steps=8), 2), use_ray=False)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("2 permanent saves in a row failed (checkpoint.max_failed_saves=2); "
                                              "the last, at step 6: saving checkpoint "), msg
    assert msg.endswith(f"retried from the newest committed checkpoint ({run}/checkpoints/step-00000002)"), msg
    assert is_infrastructure_failure(err.value)  # the executor (and a pool's launcher) retries the attempt
    mgr = CheckpointManager(str(run), _config(run).checkpoint)
    assert mgr.committed_steps() == [2] and not (run / "train_summary.json").exists()
    monkeypatch.setattr(ckpt.save, "_commit", real_commit)


def test_a_failed_final_save_is_tried_again(tmp_path, monkeypatch):
    from marin.training import checkpoint as ckpt

    real_commit, failed = ckpt.save._commit, []

    def first_final_fails(fs, path, data):
        if "/step-00000006/" in path and not failed:
            failed.append(path)
            raise OSError(13, "Access Denied")
        real_commit(fs, path, data)

    monkeypatch.setattr(ckpt.save, "_commit", first_final_fails)
    run = tmp_path / "run"
    summary = run_training(_config(run, train_steps=6), use_ray=False)
    assert failed and summary["checkpoint"].endswith("step-00000006")
    assert CheckpointManager(str(run), _config(run).checkpoint).committed_steps() == [4, 6]


def test_a_failed_save_then_a_fixed_store_resumes(tmp_path, monkeypatch):
    from marin.training import checkpoint as ckpt

    real_commit = ckpt.save._commit

    def full_disk(fs, path, data):
        if "/step-00000004/" in path:
            raise OSError(28, "No space left on device")
        real_commit(fs, path, data)

    monkeypatch.setattr(ckpt.save, "_commit", full_disk)
    run = tmp_path / "run"
    with pytest.raises(ckpt.SavesFailing):
        run_training(_failing_allowed(_config(run, train_steps=6), 1), use_ray=False)
    # a rerun (storage fixed) resumes from step 2 and finishes
    monkeypatch.setattr(ckpt.save, "_commit", real_commit)
    summary = run_training(_config(run, train_steps=6), use_ray=False)
    assert summary["resumed_from"] == 2 and summary["final_step"] == 6
