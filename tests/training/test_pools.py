"""Pool specs and the Ray launcher on the local cluster (one host per pool here)."""

import os
import subprocess
import sys
import textwrap

import pytest
import ray.cloudpickle

from marin.execution.failures import InfrastructureFailure, host_memory_error, is_infrastructure_failure
from marin.pools import (
    POOLS,
    HostOutOfMemory,
    NonRetryableError,
    PoolLaunchError,
    PoolSpec,
    get_pool,
    host_env,
    launch,
    with_device_count,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    assert host_env(get_pool("local-2host"), "")["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"


def test_a_cpu_pools_hosts_keep_the_operators_other_xla_flags():
    flags = "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    assert host_env(get_pool("local-2host"), flags)["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/d --xla_backend_optimization_level=0 --xla_force_host_platform_device_count=4")
    assert "XLA_FLAGS" not in host_env(get_pool("h200-1"), flags)  # a GPU pool's hosts inherit the cluster's
    quoted = '--xla_dump_to="/tmp/a b" --xla_force_host_platform_device_count=2'  # XLA's parser takes quotes
    assert with_device_count(quoted, None) == '--xla_dump_to="/tmp/a b"'
    assert with_device_count("", 8) == "--xla_force_host_platform_device_count=8"


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
    from marin.execution.tasks import describe_failure

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


def _die_once(ctx, marker_dir):
    """The host process exits hard (no exception reaches Ray, as a segfault or a kill) on attempt 0."""
    n = len(os.listdir(marker_dir))
    open(os.path.join(marker_dir, f"attempt-{n}"), "w").close()
    if n == 0:
        os._exit(1)
    return {"attempt": n, "pid": os.getpid()}


def test_a_host_process_that_dies_hard_is_relaunched(ray_local, tmp_path):
    """The launcher's half of a host death: the dead actor is an infrastructure failure, and the pool is
    launched again in a fresh process (the trainer's half, resuming bitwise from the last checkpoint, is
    test_trainer.py's test_crash_and_resume_is_bitwise_identical)."""
    pool = PoolSpec("tiny", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1), max_retries=1)
    [result] = launch(pool, _die_once, (str(tmp_path),))
    assert result["attempt"] == 1 and result["pid"] != os.getpid()
    assert sorted(os.listdir(tmp_path)) == ["attempt-0", "attempt-1"]


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


@pytest.mark.slow  # about 75 s beside another test: two launches of a training host; its cores are
# test_a_host_process_that_dies_hard_is_relaunched and test_trainer.py's test_crash_and_resume_is_bitwise_identical
def test_host_death_is_retried_and_resumes_from_checkpoint(ray_local, tmp_path):
    import dataclasses

    from marin.training.config import (
        AdamWConfig,
        CheckpointPolicy,
        SyntheticDataConfig,
        TelemetryConfig,
        TrainConfig,
    )
    from marin.training.metrics import read_metrics

    pool = dataclasses.replace(get_pool("local-cpu-1"), max_retries=1)
    config = TrainConfig(output_path=str(tmp_path / "run"), data=SyntheticDataConfig(vocab_size=512), model="tiny",
                         pool="local-cpu-1", train_steps=6, tokens_per_step=256, seq_len_phases=((0.0, 16),),
                         optimizer=AdamWConfig(warmup_steps=1),
                         checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None),
                         telemetry=TelemetryConfig(wandb_project=None))
    [summary] = launch(pool, _flaky_train, (config, str(tmp_path / "died-once")))
    assert summary["resumed_from"] == 4 and summary["final_step"] == 6
    assert [r["step"] for r in read_metrics(config.output_path)] == [1, 2, 3, 4, 5, 6]


# What Ray's memory monitor raised in the simulated rack at 16 nodes on a 24 GiB machine (abridged)
RAY_OOM = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, "
    "ID: 6b88499608eacea3ab513ffd30bd7f88d041f590bd6c493aefafbc00) was 22.40GB used / 23.54GB limit (0.951646)\n"
    "OOM kill reason: Memory usage 24023830528B exceeded threshold of 24012175360B (95.0% of 25275973632B limit)\n"
    "Top 10 memory users: PID\tMEM(GB)\tCOMMAND\n4324\t1.21\tray::_Host.run")


def test_rays_memory_monitor_kill_is_one_line_and_not_an_infrastructure_failure():
    error = ray.exceptions.OutOfMemoryError(RAY_OOM)
    assert host_memory_error(error) == "node 192.0.2.2: 22.40GB used / 23.54GB limit"
    assert not is_infrastructure_failure(error)  # the same program needs the same memory on a retry
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = error
    assert host_memory_error(wrapped) == "node 192.0.2.2: 22.40GB used / 23.54GB limit"
    assert host_memory_error(ray.exceptions.OutOfMemoryError("killed")) == "killed"
    assert host_memory_error(MemoryError()) is None and host_memory_error(None) is None
    assert issubclass(HostOutOfMemory, PoolLaunchError) and not issubclass(HostOutOfMemory, InfrastructureFailure)


def test_a_host_killed_by_rays_memory_monitor_fails_the_pool_once_in_one_line(tmp_path):
    """A Ray cluster whose memory monitor kills any worker (threshold 1% of the machine), in a process
    of its own: the host is killed, and the launcher says so in one line instead of retrying."""
    script = tmp_path / "oom.py"
    script.write_text(textwrap.dedent("""
        import time
        import ray
        from marin.pools import HostOutOfMemory, PoolSpec, launch

        def host(ctx):
            time.sleep(120)

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        pool = PoolSpec("oom-cpu", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1), max_retries=2)
        try:
            launch(pool, host)
        except HostOutOfMemory as e:
            print("ONE LINE", str(e).count("\\n") == 0, str(e))
    """))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)
    env.update(RAY_memory_usage_threshold="0.01", RAY_memory_monitor_refresh_ms="100", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("ONE LINE")]
    assert line.startswith("ONE LINE True pool oom-cpu: Ray's memory monitor killed a host, its node low on memory "
                           "(node "), line
    assert "a retry would fail the same way" in line
