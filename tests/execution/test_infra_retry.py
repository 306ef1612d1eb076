"""Infrastructure failures are retried by the executor by itself; the step's own failures are not.

The end-to-end test kills the training host of a real ``marin run`` with SIGKILL in the middle of
training: the step finishes by itself, its status events record the retried attempt, and its final
checkpoint is the same as that of a run that was never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from marin.execution import ExecutorError
from marin.execution.failures import InfrastructureFailure, Preempted, is_infrastructure_failure
from marin.execution.retry import StorageUnavailable

sys.path.insert(0, os.path.dirname(__file__))
from test_executor import body, executions, run, step  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_what_counts_as_an_infrastructure_failure():
    import ray.exceptions as rex

    assert is_infrastructure_failure(rex.WorkerCrashedError())
    assert is_infrastructure_failure(rex.NodeDiedError("node 3 died"))
    assert is_infrastructure_failure(Preempted("SIGTERM at step 40; checkpoint saved"))
    assert is_infrastructure_failure(StorageUnavailable("write s3://b/x: unreachable for 300s"))
    wrapped = RuntimeError("pool failed")
    wrapped.__cause__ = rex.ActorDiedError()
    assert is_infrastructure_failure(wrapped)
    for own in (ValueError("bad config"), ZeroDivisionError(), RuntimeError("loss is nan"), FileNotFoundError("x")):
        assert not is_infrastructure_failure(own), own


def test_a_collective_whose_peer_is_gone_is_an_infrastructure_failure():
    """What a surviving host of a pool raises when a peer was killed or is too late for a collective (the
    message a simulated rack's relaunch saw), as jax 0.10 raises it: retried, unlike the step's own errors."""
    import jax

    late_peer = jax.errors.JaxRuntimeError(
        "UNKNOWN: Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out with key: "
        "cpu:gloo/0,2048,4096,6144/1 and duration: 29.999999959s")
    assert is_infrastructure_failure(late_peer)
    assert not is_infrastructure_failure(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shapes (4,) and (5,)"))


def flaky_infra(cfg) -> None:
    """Fails with an infrastructure failure on its first two executions, then does its work."""
    n = len(open(cfg.log).read().splitlines()) if os.path.exists(cfg.log) else 0
    with open(cfg.log, "a") as f:
        f.write(f"{cfg.out}\t{time.time()}\tstart\n")
    if n < 2:
        raise InfrastructureFailure(f"host lost (attempt {n + 1})")
    os.remove(cfg.log)
    body(cfg)


def own_bug(cfg) -> None:
    with open(cfg.log, "a") as f:
        f.write(f"{cfg.out}\t{time.time()}\tstart\n")
    raise ValueError("bad config key 'lr_schedual'")


def test_infrastructure_failures_are_retried_and_recorded_bugs_fail_at_once(tmp_path, ray_local):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    s = step("flaky", tmp_path / "log", fn=flaky_infra)
    result = run([s], tmp_path / "out", infra_retries=2)
    (path,) = result.outcome
    assert result.outcome[path] == "succeeded"
    events = json.loads(Path(path, ".executor_status").read_text())["events"]
    retries = [e["message"] for e in events if e["status"] == "RUNNING" and e.get("message")]
    assert len(retries) == 2
    assert retries[0].startswith(
        "infrastructure failure (InfrastructureFailure: host lost (attempt 1)); attempt 2 of 3")
    assert [e["status"] for e in events][-1] == "SUCCESS"

    bug = step("bug", tmp_path / "bug-log", fn=own_bug)
    with pytest.raises(ExecutorError) as e:
        run([bug], tmp_path / "out", infra_retries=2)
    assert "ValueError: bad config key" in str(e.value)
    assert len(executions(tmp_path / "bug-log")) == 1  # not retried: it would fail the same way
    # --retry_failed reruns that one step (no --force_run_failed for every failed step)
    with pytest.raises(ExecutorError) as again:
        run([bug], tmp_path / "out")
    assert "--retry_failed STEP (that step) or --force_run_failed true" in str(again.value)
    with pytest.raises(ExecutorError):
        run([bug], tmp_path / "out", retry_failed=["bug"])
    assert len(executions(tmp_path / "bug-log")) == 2
    with pytest.raises(ExecutorError) as none:
        run([bug], tmp_path / "out", retry_failed=["nothing-like-it"])
    assert str(none.value) == ("--retry_failed nothing-like-it names no failed step of this experiment "
                               "(failed steps: bug)")


def test_the_retry_limit_is_the_steps_own_unless_the_flag_sets_one_for_all(tmp_path, ray_local):
    """A step that declares no retries (tokenize, fits, reports) fails at its first infrastructure
    failure; one on a pool that retries is retried; ``--infra_retries N`` overrides both."""
    import dataclasses

    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    plain = step("plain", tmp_path / "plain-log", fn=flaky_infra)
    assert plain.infra_retries is None
    with pytest.raises(ExecutorError) as e:
        run([plain], tmp_path / "out")
    assert "InfrastructureFailure: host lost (attempt 1)" in str(e.value)
    assert "retried" not in str(e.value) and len(executions(tmp_path / "plain-log")) == 1

    pooled = dataclasses.replace(step("pooled", tmp_path / "pooled-log", fn=flaky_infra), infra_retries=2)
    (path,) = run([pooled], tmp_path / "out").outcome.values()
    assert path == "succeeded"

    capped = dataclasses.replace(step("capped", tmp_path / "capped-log", fn=flaky_infra), infra_retries=2)
    with pytest.raises(ExecutorError) as e:
        run([capped], tmp_path / "out", infra_retries=0)
    assert len(executions(tmp_path / "capped-log")) == 1 and "retried" not in str(e.value)


def test_each_infrastructure_failure_waits_twice_as_long_as_the_one_before_up_to_a_minute():
    """The run's bookkeeping of resubmissions: the limit (the flag's, else the step's), which
    failures retry, the backoff 2 s doubling to 60 s, and a step due only once its backoff is over."""
    import dataclasses

    from marin.execution import plan_steps
    from marin.execution.infra_retry import InfraRetries

    now = [100.0]
    (s,) = plan_steps([dataclasses.replace(step("s", "/unused"), infra_retries=7)], "/tmp/unused-prefix").steps
    retries = InfraRetries(None, clock=lambda: now[0])
    assert retries.limit(s) == 7 and InfraRetries(0).limit(s) == 0
    assert retries.retries(s, InfrastructureFailure("host lost")) and not retries.retries(s, ValueError("bug"))
    delays = []
    for n in range(1, 8):
        assert retries.schedule(s)[0] == n
        delays.append(retries.due_at[s] - now[0])
        assert retries.waiting and retries.pop_due() == []
        now[0] = retries.due_at[s]
        assert retries.pop_due() == [s] and not retries.waiting
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert not retries.retries(s, InfrastructureFailure("host lost"))  # its 7 retries are spent
    assert retries.after(s, "E: x") == "E: x (after 7 retried infrastructure failure(s))"
    assert retries.describe(s, "E: x", 1, 2.0) == (
        "infrastructure failure (E: x); attempt 2 of 8 starts in 2s from what the step committed")


def test_training_and_evaluation_take_their_pools_retries_other_steps_none():
    from experiments.defaults import default_eval, default_train
    from marin.execution import ExecutorStep, InvalidStepError
    from marin.pools import POOLS, SHIPPED_POOL_NAMES
    from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig

    assert {name: POOLS[name].infra_retries for name in SHIPPED_POOL_NAMES} == {
        "local-cpu": 0, "local-cpu-1": 0, "local-cpu-ep8": 0, "local-2host": 0,
        "h200-1": 2, "gb200-rack": 2, "gb200-11racks": 2}
    kw = dict(mixture=SyntheticDataConfig(vocab_size=512), model="tiny", train_steps=4, tokens_per_step=128,
              seq_len_phases=((0.0, 16),), optimizer=AdamWConfig(warmup_steps=1),
              telemetry=TelemetryConfig(wandb_project=None), memory_check="off")
    local = default_train("probe/local", pool="local-cpu-1", **kw)
    gpu = default_train("probe/gpu", pool="gb200-rack", checkpoint=CheckpointPolicy(preemption_grace_s=30.0), **kw)
    assert (local.infra_retries, local.stop_grace_s) == (0, 0.0)
    assert (gpu.infra_retries, gpu.stop_grace_s) == (2, 30.0)
    assert default_eval("probe/eval", gpu, held_out=True).infra_retries == 2  # on the training step's pool
    assert default_eval("probe/eval", gpu, held_out=True, pool="local-cpu").infra_retries == 0
    with pytest.raises(InvalidStepError, match="infra_retries must be a count >= 0 or None, got -1"):
        ExecutorStep("x", print, None, infra_retries=-1)


def test_infrastructure_failures_past_the_limit_fail_with_the_count(tmp_path, ray_local):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    s = step("flaky2", tmp_path / "log", fn=flaky_infra)
    with pytest.raises(ExecutorError) as e:
        run([s], tmp_path / "out", infra_retries=1)
    assert "InfrastructureFailure: host lost (attempt 2) (after 1 retried infrastructure failure(s))" in str(e.value)


TRAIN_EXPERIMENT = textwrap.dedent(
    '''
    from experiments.defaults import default_train
    from marin.execution import executor_main
    from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig

    train = default_train("probe/train", mixture=SyntheticDataConfig(vocab_size=512), model="tiny", pool="local-cpu-1",
                          train_steps=120, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                          optimizer=AdamWConfig(warmup_steps=1),
                          checkpoint=CheckpointPolicy(every_steps=20, every_minutes=None),
                          telemetry=TelemetryConfig(wandb_project=None))
    if __name__ == "__main__":
        executor_main(steps=[train])
    '''
)


def run_killing_the_training_host(exp_text: str, tmp_path: Path, *, infra_retries: int, kill_at_step: int,
                                  start_s: float, finish_s: float) -> tuple[int, str, Path]:
    """Run the experiment ``exp_text`` (with ``probe/train``, checkpointing every 20 steps) through
    ``marin run --infra_retries N`` and kill -9 its ``ray::_Host`` training process once a checkpoint
    at or past ``kill_at_step`` (and before the final 120) is committed, within ``start_s`` seconds;
    returns the run's exit status, its stderr and its store once it finished (within ``finish_s``)."""
    from marin.execution.reaper import processes_with_env
    from marin.training.checkpoint import CheckpointManager

    exp = tmp_path / "exp.py"
    exp.write_text(exp_text)
    store = tmp_path / "store"
    marker = f"MARIN_TEST_MARKER=marin-test-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "MARIN_TEST_MARKER": marker.split("=", 1)[1]}
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix", str(store),
                             "--progress", "false", "--infra_retries", str(infra_retries)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env, start_new_session=True)
    try:
        deadline = time.time() + start_s
        killed = None
        while time.time() < deadline and proc.poll() is None and killed is None:
            runs = list(store.glob("probe/train-*"))
            if runs and (runs[0] / "checkpoints").exists():
                steps = CheckpointManager(str(runs[0]), _policy()).committed_steps()
                if steps and steps[-1] >= kill_at_step:
                    hosts = [pid for pid, cmd in processes_with_env(marker).items() if cmd.startswith("ray::_Host")]
                    if hosts:
                        os.kill(hosts[0], signal.SIGKILL)
                        killed = steps[-1]
            time.sleep(0.1)
        assert killed is not None and killed < 120, proc.communicate(timeout=60)
        _, err = proc.communicate(timeout=finish_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err, store


def _final_state(run_dir: Path, config) -> tuple[int, dict]:
    from marin.training.checkpoint import CheckpointManager
    from marin.training.trainer import init_host_state, model_config

    template = init_host_state(config, model_config(config, 512))
    step_, tree, _ = CheckpointManager(str(run_dir), config.checkpoint).restore_latest(template=template)
    import jax

    return step_, {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.slow  # about 90 s: two launches of a training host, and an uninterrupted run to compare with
def test_kill_9_of_the_training_host_is_retried_and_the_final_checkpoint_matches(tmp_path):
    from marin.training.metrics import read_metrics

    returncode, err, store = run_killing_the_training_host(TRAIN_EXPERIMENT, tmp_path, infra_retries=2, kill_at_step=40,
                                                           start_s=240, finish_s=400)
    assert returncode == 0, err
    assert "RETRY probe/train: infrastructure failure" in err
    (run_dir,) = store.glob("probe/train-*")
    record = json.loads((run_dir / ".executor_status").read_text())
    assert [e["status"] for e in record["events"]] == ["RUNNING", "RUNNING", "SUCCESS"]
    assert "attempt 2 of 3" in record["events"][1]["message"]
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["final_step"] == 120 and summary["resumed_from"] is not None and summary["resumed_from"] >= 40
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(1, 121))

    # the same training, never interrupted, in this process
    from marin.training.trainer import run_training

    config = _config(tmp_path / "uninterrupted")
    run_training(config, use_ray=False)
    step_a, a = _final_state(run_dir, config)
    step_b, b = _final_state(tmp_path / "uninterrupted", config)
    assert step_a == step_b == 120 and a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _config(path):
    from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig, TrainConfig

    return TrainConfig(output_path=str(path), data=SyntheticDataConfig(vocab_size=512), model="tiny",
                       pool="local-cpu-1", train_steps=120, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                       optimizer=AdamWConfig(warmup_steps=1),
                       checkpoint=CheckpointPolicy(every_steps=20, every_minutes=None),
                       telemetry=TelemetryConfig(wandb_project=None))


def _policy():
    return _config("/nonexistent").checkpoint


def test_retry_failed_is_spelt_either_way_and_takes_several_steps():
    from marin.execution.main import parse_executor_args

    assert parse_executor_args(["--retry-failed", "probe/train", "eval.*", "--infra_retries", "0"]).retry_failed == [
        "probe/train", "eval.*"]
    config = parse_executor_args(["--retry_failed=probe/train", "--run_only", "x"])
    assert config.retry_failed == ["probe/train"] and config.run_only == ["x"] and config.infra_retries is None
