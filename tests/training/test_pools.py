"""Pool specs and the Ray launcher on the local cluster (one host per pool here)."""

import os
import sys

import pytest
import ray.cloudpickle

from marin.execution.failures import InfrastructureFailure
from marin.training.pools import (
    POOLS,
    NonRetryableError,
    PoolLaunchError,
    PoolSpec,
    get_pool,
    host_env,
    launch,
)


def test_presets_are_consistent():
    for name, pool in POOLS.items():
        assert pool.name == name
        assert pool.mesh[0] * pool.mesh[1] == pool.num_devices
    rack = get_pool("gb200-rack")
    assert (rack.hosts, rack.devices_per_host, rack.mesh) == (16, 4, (1, 64))  # EP 64 inside a rack
    hero = get_pool("gb200-11racks")
    assert (hero.racks, hero.hosts_per_rack, hero.mesh) == (11, 16, (11, 64))  # DP 11 across racks
    assert hero.bundle() == {"CPU": 8.0, "GPU": 4.0}


def test_pool_validation():
    with pytest.raises(ValueError, match="mesh"):
        PoolSpec("bad", hosts=2, devices_per_host=4, accelerator="cpu", mesh=(2, 2))
    with pytest.raises(ValueError, match="inside a rack"):
        PoolSpec("bad", hosts=4, devices_per_host=4, accelerator="GB200", mesh=(1, 16), racks=2)
    with pytest.raises(KeyError, match="known"):
        get_pool("nope")
    assert host_env(get_pool("local-2host"))["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


# Host functions below travel to Ray workers by value (the workers cannot import this test module).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _report(ctx, tag):
    import jax

    return {"tag": tag, "pid": os.getpid(), "process_id": ctx.process_id, "devices": jax.device_count()}


def _fail(ctx, marker_dir):
    # count attempts through the filesystem: each attempt is a fresh actor process
    n = len(os.listdir(marker_dir))
    open(os.path.join(marker_dir, f"attempt-{n}"), "w").close()
    raise InfrastructureFailure(f"host lost on attempt {n}")


def _bug(ctx, marker_dir):
    n = len(os.listdir(marker_dir))
    open(os.path.join(marker_dir, f"attempt-{n}"), "w").close()
    raise ValueError("bad config key 'lr_schedual'")


def _diverge(ctx):
    raise NonRetryableError("loss is nan at step 3")


def test_launch_runs_one_jax_process_per_host(ray_local):
    pool = get_pool("local-cpu")
    [result] = launch(pool, _report, ("x",))
    assert result["tag"] == "x" and result["devices"] == 8 and result["pid"] != os.getpid()


def test_launch_retries_then_fails(ray_local, tmp_path):
    pool = PoolSpec("tiny", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1), max_retries=1)
    with pytest.raises(PoolLaunchError, match="after 2 attempt") as err:
        launch(pool, _fail, (str(tmp_path),))
    assert "host lost on attempt 1" in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["attempt-0", "attempt-1"]
    # the executor records the first line of a failure: it must name the real cause
    from marin.execution.executor import describe_failure

    reason, _ = describe_failure(err.value)
    assert reason == ("PoolLostError: pool tiny failed after 2 attempt(s); last: InfrastructureFailure: host lost "
                      "on attempt 1")
    from marin.execution.failures import is_infrastructure_failure

    assert is_infrastructure_failure(err.value)  # the executor retries the step by itself


def test_launch_does_not_retry_a_bug(ray_local, tmp_path):
    pool = PoolSpec("tiny", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1), max_retries=3)
    with pytest.raises(ValueError, match="bad config key"):
        launch(pool, _bug, (str(tmp_path),))
    assert os.listdir(tmp_path) == ["attempt-0"]  # one attempt: a retry would fail the same way


def test_launch_does_not_retry_divergence(ray_local):
    pool = PoolSpec("tiny", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1), max_retries=3)
    with pytest.raises(NonRetryableError, match="nan at step 3"):
        launch(pool, _diverge)


def test_unsatisfiable_pool_fails_fast(ray_local):
    pool = PoolSpec("huge", hosts=1, devices_per_host=4, accelerator="GB200", mesh=(1, 4),
                    device_resource="GPU", ready_timeout_s=1.0)
    with pytest.raises(PoolLaunchError, match=r"no node of the Ray cluster can hold 1 x \(1 CPU \+ 4 GPU\)"):
        launch(pool, _report, ("x",))


def _flaky_train(ctx, config, marker):
    """First attempt: the host process dies hard right after the step-4 checkpoint is committed."""
    from marin.training import checkpoint as ckpt
    from marin.training.trainer import train_on_host

    if not os.path.exists(marker):
        open(marker, "w").close()
        real_save = ckpt.CheckpointManager.save

        def save_then_die(self, step, tree, metadata, **kw):
            path = real_save(self, step, tree, metadata, **kw)
            if step == 4:
                self.wait()  # saves are asynchronous: die once this one is committed
                os._exit(1)
            return path

        ckpt.CheckpointManager.save = save_then_die
    return train_on_host(ctx, config)


def test_host_death_is_retried_and_resumes_from_checkpoint(ray_local, tmp_path):
    import dataclasses

    from marin.training.config import SyntheticDataConfig, TrainConfig
    from marin.training.metrics import read_metrics

    pool = dataclasses.replace(get_pool("local-cpu-1"), max_retries=1)
    config = TrainConfig(output_path=str(tmp_path / "run"), data=SyntheticDataConfig(vocab_size=512), model="tiny",
                         pool="local-cpu-1", train_steps=6, tokens_per_step=256, seq_len_phases=((0.0, 16),),
                         warmup_steps=1, checkpoint_every_steps=2, checkpoint_every_minutes=None, wandb_project=None)
    [summary] = launch(pool, _flaky_train, (config, str(tmp_path / "died-once")))
    assert summary["resumed_from"] == 4 and summary["final_step"] == 6
    assert [r["step"] for r in read_metrics(config.output_path)] == [1, 2, 3, 4, 5, 6]
