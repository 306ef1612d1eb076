"""Two-tier checkpoints: sparse permanent ones under the step directory and a rolling temporary one on a
fast store (one kept), on local disk and on an S3-compatible server. Resume takes the newest committed
checkpoint of either tier; a newer permanent one deletes the temporary one; a temporary store that is
gone, unreachable or damaged leaves the resume to the permanent ones."""

import logging
import shutil
import time
import uuid

import jax.numpy as jnp
import numpy as np
import pytest

from marin.models.config import get_preset
from marin.training import checkpoint as ckpt
from marin.training.checkpoint import (
    PERMANENT,
    TEMPORARY,
    CheckpointManager,
    CheckpointPolicy,
    temp_checkpoint_root,
    write_checkpoint,
)


def _state(seed: int):
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32), "count": jnp.asarray(seed, jnp.int32)}


def _same(a, b) -> bool:
    return all(np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)


def _new_bucket(s3_endpoint) -> str:
    import boto3
    import fsspec

    name = f"fast-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    fsspec.filesystem("s3").invalidate_cache()
    return name


def _delete_bucket(s3_endpoint, name: str) -> None:
    import boto3
    import fsspec

    bucket = boto3.resource("s3", endpoint_url=s3_endpoint).Bucket(name)
    bucket.objects.all().delete()
    bucket.delete()
    fsspec.filesystem("s3").invalidate_cache()


class _Stores:
    """A run directory on the durable store and a fast store beside it, and a way to make the fast one vanish."""

    def __init__(self, request, tmp_path):
        self.kind = request.param
        if self.kind == "local":
            self.run, self.fast = str(tmp_path / "durable" / "train-abc123"), str(tmp_path / "fast")
            self.vanish = lambda: shutil.rmtree(self.fast)
        else:
            endpoint = request.getfixturevalue("s3_endpoint")
            durable = request.getfixturevalue("s3_bucket")
            name = _new_bucket(endpoint)
            self.run, self.fast = f"{durable}/runs/train-abc123", f"s3://{name}/tmp"
            self.vanish = lambda: _delete_bucket(endpoint, name)

    def manager(self, **policy) -> CheckpointManager:
        return CheckpointManager(self.run, CheckpointPolicy(**{"every_steps": 4, "temp_every_minutes": 60.0, **policy}),
                                 temp_path=self.fast)


@pytest.fixture(params=["local", "s3"])
def stores(request, tmp_path):
    return _Stores(request, tmp_path)


def test_resume_takes_the_newest_of_both_tiers_and_a_newer_permanent_one_deletes_the_temporary(stores):
    mgr = stores.manager()
    mgr.save(4, _state(4), {"tokens": 4})
    mgr.save_temporary(5, _state(5), {"tokens": 5})
    mgr.save_temporary(6, _state(6), {"tokens": 6}, blocking=True)
    assert mgr.temporary.committed_steps() == [6]  # one kept: 5 went when 6 committed
    assert mgr.committed_steps() == [4]  # the permanent ones: what evaluation, sampling and export read
    assert ckpt.committed_steps(stores.run) == [4]

    fresh = stores.manager()  # what a relaunched pool sees
    assert fresh.latest_step() == 6 and fresh.path_for(6).startswith(temp_checkpoint_root(stores.fast, stores.run))
    step, tree, meta = fresh.restore_latest(template=_state(0))
    assert step == 6 and meta == {"tokens": 6} and _same(tree, _state(6))

    fresh.save(8, _state(8), {"tokens": 8}, blocking=True)
    assert fresh.temporary.committed_steps() == [] and fresh.temporary.step_dirs() == {}
    assert fresh.latest_step() == 8 and fresh.committed_steps() == [4, 8]
    mgr.close()
    fresh.close()


def test_a_temporary_store_that_disappears_leaves_the_resume_to_the_permanent_one(stores, caplog):
    mgr = stores.manager()
    mgr.save(4, _state(4), {"tokens": 4})
    mgr.save_temporary(6, _state(6), {"tokens": 6}, blocking=True)
    stores.vanish()

    fresh = stores.manager()
    with caplog.at_level(logging.WARNING):
        step, tree, meta = fresh.restore_latest(template=_state(0))
    assert step == 4 and _same(tree, _state(4))
    # and training goes on: a temporary save into a store that is gone is logged and skipped, never fatal
    fresh.mark_restored(4)
    fresh.save_temporary(5, _state(5), {"tokens": 5}, blocking=True)
    fresh.save(8, _state(8), {"tokens": 8}, blocking=True)
    assert fresh.committed_steps() == [4, 8] and fresh.latest_step() == 8
    fresh.close()
    mgr.close()


def test_an_unreachable_temporary_store_is_a_warning_not_a_failure(stores, caplog):
    mgr = stores.manager()
    mgr.save(4, _state(4), {"tokens": 4}, blocking=True)
    gone = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/tmp" if stores.kind == "s3" else "/proc/no/such/place"
    other = CheckpointManager(stores.run, CheckpointPolicy(temp_every_minutes=60.0), temp_path=gone)
    with caplog.at_level(logging.WARNING):
        step, _, _ = other.restore_latest(template=_state(0))
        other.clear_uncommitted()
    assert step == 4
    mgr.close()


def test_a_damaged_temporary_checkpoint_falls_back_to_the_permanent_one(tmp_path, caplog):
    run, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    mgr = CheckpointManager(run, CheckpointPolicy(every_steps=4, temp_every_minutes=60.0), temp_path=fast)
    mgr.save(4, _state(4), {"tokens": 4})
    mgr.save_temporary(6, _state(6), {"tokens": 6}, blocking=True)
    temp_dir = tmp_path / "fast" / temp_checkpoint_root("", run).lstrip("/") / "step-00000006"
    [chunk] = [p for p in (temp_dir / "arrays" / "leaf-00001").rglob("*") if p.is_file() and p.name != "zarr.json"]
    chunk.write_bytes(b"\0" + chunk.read_bytes()[1:])  # a flipped byte: its crc32c fails
    with caplog.at_level(logging.WARNING):
        step, tree, _ = mgr.restore_latest(template=_state(0))
    assert step == 4 and _same(tree, _state(4))
    assert any("temporary checkpoint at step 6 does not verify" in r.getMessage() for r in caplog.records)
    assert mgr.latest_step() == 4  # moved aside in its own store, out of discovery
    mgr.close()


def test_an_incomplete_temporary_save_blocks_neither_the_next_save_nor_a_restore(tmp_path):
    """A host killed mid-save leaves a temporary step directory with parts but no COMMIT: a relaunch
    restores the newest committed checkpoint, clears the leftover, and its next temporary save commits."""
    from marin.training.checkpoint.format import COMMIT_FILE

    run, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    mgr = CheckpointManager(run, CheckpointPolicy(every_steps=4, temp_every_minutes=60.0), temp_path=fast)
    mgr.save(4, _state(4), {"tokens": 4}, blocking=True)
    mgr.save_temporary(6, _state(6), {"tokens": 6}, blocking=True)
    mgr.close()
    temp_dir = tmp_path / "fast" / temp_checkpoint_root("", run).lstrip("/") / "step-00000006"
    (temp_dir / COMMIT_FILE).unlink()  # the save that died before process 0 committed it
    assert temp_dir.is_dir() and any(temp_dir.rglob("*"))

    fresh = CheckpointManager(run, CheckpointPolicy(every_steps=4, temp_every_minutes=60.0), temp_path=fast)
    step, tree, _ = fresh.restore_latest(template=_state(0))
    assert step == 4 and _same(tree, _state(4))  # the incomplete one is never read
    fresh.clear_uncommitted()  # what the writer does before training starts
    assert not temp_dir.exists()
    fresh.mark_restored(4)
    fresh.save_temporary(5, _state(5), {"tokens": 5}, blocking=True)  # the next save is not blocked
    assert fresh.temporary.committed_steps() == [5]
    fresh.close()
    again = CheckpointManager(run, CheckpointPolicy(every_steps=4, temp_every_minutes=60.0), temp_path=fast)
    step, tree, _ = again.restore_latest(template=_state(0))
    assert step == 5 and _same(tree, _state(5))
    again.close()


def test_a_step_in_both_tiers_is_read_from_the_permanent_one_and_the_run_directories_do_not_collide(tmp_path):
    run, fast = str(tmp_path / "run"), str(tmp_path / "fast")
    mgr = CheckpointManager(run, CheckpointPolicy(temp_every_minutes=60.0), temp_path=fast)
    mgr.save_temporary(4, _state(40), {}, blocking=True)
    write_checkpoint(mgr.permanent.url(4), _state(4), {}, step=4)
    assert mgr.committed() == {4: mgr.permanent.url(4)}
    assert _same(mgr.restore_latest(template=_state(0))[1], _state(4))
    # the same step name and hash under another prefix gets its own temporary directory
    assert temp_checkpoint_root(fast, str(tmp_path / "a" / "train-abc")) != temp_checkpoint_root(
        fast, str(tmp_path / "b" / "train-abc"))
    assert temp_checkpoint_root("s3://fast/tmp/", "s3://durable/x/train-abc").startswith("s3://fast/tmp/train-abc-")
    mgr.close()


def test_which_tier_is_due():
    mgr = CheckpointManager("/nonexistent/run", CheckpointPolicy(every_steps=100, every_minutes=None,
                                                                 temp_every_minutes=60.0),
                            temp_path="/nonexistent/fast")
    mgr.mark_restored(10)
    now = time.monotonic()
    assert mgr.due(11, now=now + 60) is None
    assert mgr.due(11, now=now + 3601) == TEMPORARY
    assert mgr.due(100, now=now + 1) == PERMANENT  # the permanent cadence wins when both are due
    assert mgr.due(10, now=now + 3601) is None  # the step just restored (or saved) is not saved again
    without_store = CheckpointManager("/nonexistent/run", CheckpointPolicy(every_minutes=None, temp_every_minutes=60.0))
    without_store.mark_restored(10)
    assert without_store.due(11, now=time.monotonic() + 3601) is None
    with pytest.raises(ValueError, match="cannot save a 'temporary' checkpoint"):
        without_store.save_temporary(11, _state(1), {})
    with pytest.raises(ValueError, match="checkpoint.temp_every_minutes must be > 0"):
        CheckpointPolicy(temp_every_minutes=0)


@pytest.mark.slow  # three tiny training runs; the manager tests above are the fast check of each rule
def test_a_run_resumes_from_its_temporary_checkpoint_and_ends_with_none(tmp_path, monkeypatch):
    """The trainer: permanent every 4 steps, temporary every step; a crash in step 6 resumes from the
    temporary step-5 one, with one metrics record per step and the losses of an uninterrupted run."""
    from marin.training import trainer
    from marin.training.config import AdamWConfig, SyntheticDataConfig, TelemetryConfig, TrainConfig
    from marin.training.metrics import read_metrics

    def config(name: str) -> TrainConfig:
        return TrainConfig(output_path=str(tmp_path / name), data=SyntheticDataConfig(vocab_size=512),
                           model=get_preset("tiny", n_layers=1),
                           pool="local-cpu-1", train_steps=8, tokens_per_step=256, seq_len_phases=((0.0, 16),),
                           optimizer=AdamWConfig(warmup_steps=1),
                           checkpoint=CheckpointPolicy(every_steps=4, every_minutes=None, temp_every_minutes=1e-6,
                                                       temp_path=str(tmp_path / "fast")),
                           telemetry=TelemetryConfig(wandb_project=None, progress_every_s=0.0))

    clean = config("clean")
    trainer.run_training(clean, use_ray=False)
    crashy = config("crashy")
    real = trainer.report_step

    def crash_in_step_6(step, seconds):
        if step == 6:
            raise _Crash("simulated host loss in step 6")
        real(step, seconds)

    monkeypatch.setattr(trainer, "report_step", crash_in_step_6)
    with pytest.raises(_Crash):
        trainer.run_training(crashy, use_ray=False)
    mgr = CheckpointManager(crashy.output_path, crashy.checkpoint, temp_path=crashy.checkpoint.temp_path)
    assert mgr.committed_steps() == [4] and mgr.temporary.committed_steps() == [5]
    monkeypatch.setattr(trainer, "report_step", real)

    summary = trainer.run_training(crashy, use_ray=False)
    assert summary["resumed_from"] == 5 and summary["final_step"] == 8
    assert [r["step"] for r in read_metrics(crashy.output_path)] == list(range(1, 9))
    # same process, same machine, same programs: the resumed run is the uninterrupted one bit for bit
    assert [r["loss"] for r in read_metrics(crashy.output_path)] == [r["loss"] for r in read_metrics(clean.output_path)]
    assert mgr.committed_steps() == [4, 8] and mgr.temporary.step_dirs() == {}  # the final permanent one took it


def test_the_config_says_what_a_temporary_checkpoint_needs():
    from marin.training.config import SyntheticDataConfig, TrainConfig

    with pytest.raises(ValueError, match="checkpoint.temp_every_minutes needs checkpoint.temp_path"):
        TrainConfig(output_path="/x", data=SyntheticDataConfig(), checkpoint=CheckpointPolicy(temp_every_minutes=60.0))


class _Crash(RuntimeError):
    pass
