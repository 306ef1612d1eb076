"""SIGTERM to a training process (what a scheduler sends before it kills a preempted node): with a grace
period configured, training stops at the next step with a final checkpoint there, and a rerun resumes
from it; without one (the default) SIGTERM is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from marin.execution.failures import is_infrastructure_failure
from marin.pools import with_device_count
from marin.training.checkpoint import CheckpointManager
from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig, TrainConfig
from marin.training.metrics import read_metrics
from marin.training.preemption import Preempted, PreemptionWatch
from marin.training.trainer import run_training

REPO = Path(__file__).resolve().parents[2]

TRAIN = textwrap.dedent(
    """
    import sys
    from marin.training.config import (AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig,
                                       TrainConfig)
    from marin.training.preemption import Preempted
    from marin.training.trainer import run_training

    config = TrainConfig(output_path=sys.argv[1], data=SyntheticDataConfig(vocab_size=512), model="tiny",
                         pool="local-cpu-1", train_steps=100000, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                         optimizer=AdamWConfig(warmup_steps=1),
                         checkpoint=CheckpointPolicy(every_steps=100000, every_minutes=None,
                                                     preemption_grace_s=float(sys.argv[2])),
                         telemetry=TelemetryConfig(wandb_project=None, progress_every_s=1e9))
    try:
        run_training(config, use_ray=False)
    except Preempted as e:
        print(f"preempted: {e}", flush=True)
        raise SystemExit(143)
    """
)


def _config(path, **kw) -> TrainConfig:
    base = dict(output_path=str(path), data=SyntheticDataConfig(vocab_size=512), model="tiny", pool="local-cpu-1",
                train_steps=100000, tokens_per_step=128, seq_len_phases=((0.0, 16),),
                optimizer=AdamWConfig(warmup_steps=1),
                checkpoint=CheckpointPolicy(every_steps=100000, every_minutes=None),
                telemetry=TelemetryConfig(wandb_project=None, progress_every_s=1e9))
    return TrainConfig(**{**base, **kw})


def _train_then_sigterm(tmp_path: Path, grace: float) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", TRAIN, str(run_dir), str(grace)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), run_dir


@pytest.mark.slow  # about 60 s on a loaded 2-core machine: a training process, then its resume
def test_sigterm_with_a_grace_period_saves_a_final_checkpoint_and_the_rerun_resumes_there(tmp_path):
    r, run_dir = _train_then_sigterm(tmp_path, grace=60)
    assert r.returncode == 143, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("preempted: SIGTERM at step "), r.stdout
    step = int(line.split("at step ")[1].split(":")[0])
    assert line.endswith(f": final checkpoint {run_dir}/checkpoints/step-{step:08d}")
    manager = CheckpointManager(str(run_dir), _config(run_dir).checkpoint)
    assert manager.committed_steps() == [step]  # only the final one: the cadence never came due
    assert [rec["step"] for rec in read_metrics(str(run_dir))] == list(range(1, step + 1))
    # the rerun (what the executor's retry does) continues from that checkpoint
    summary = run_training(_config(run_dir, train_steps=step + 3), use_ray=False)
    assert summary["resumed_from"] == step and summary["final_step"] == step + 3
    assert [rec["step"] for rec in read_metrics(str(run_dir))] == list(range(1, step + 4))


def test_preempted_is_an_infrastructure_failure_and_the_watch_budgets_the_save():
    assert is_infrastructure_failure(Preempted("SIGTERM at step 3"))
    watch = PreemptionWatch(30.0)
    assert not watch.requested and watch.time_left() == 0.0
    before = signal.getsignal(signal.SIGTERM)
    with watch:
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal to this process: only the flag is set
        assert watch.requested and 29 < watch.time_left() <= 30
        assert watch.worth_saving(10.0) and not watch.worth_saving(25.0) and watch.worth_saving(None)
    assert signal.getsignal(signal.SIGTERM) is before  # given back
    off = PreemptionWatch(0.0)  # the default: SIGTERM is not caught at all
    with off:
        assert not off.active and signal.getsignal(signal.SIGTERM) is before


DRIVER_EXPERIMENT = textwrap.dedent(
    '''
    from experiments.defaults import default_train
    from marin.execution import executor_main
    from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig

    train = default_train("probe/train", mixture=SyntheticDataConfig(vocab_size=512), model="tiny", pool="local-cpu-1",
                          train_steps=400, tokens_per_step=512, seq_len_phases=((0.0, 16),),
                          optimizer=AdamWConfig(warmup_steps=1),
                          checkpoint=CheckpointPolicy(every_steps=40, every_minutes=None, preemption_grace_s=60.0),
                          telemetry=TelemetryConfig(wandb_project=None))
    if __name__ == "__main__":
        executor_main(steps=[train])
    '''
)


@pytest.mark.slow  # about 60 s: a `marin run` stopped mid-training, then the rerun that finishes it
def test_sigterm_to_the_driver_gives_training_its_grace_period_and_the_rerun_resumes_there(tmp_path):
    """The scheduler signals ``marin run``, not the training host: the driver forwards the stop, the
    host saves a final checkpoint at the step it reached (past the last periodic one), the step is
    INTERRUPTED naming it, and the rerun resumes from it."""
    import json

    exp, store = tmp_path / "exp.py", tmp_path / "store"
    exp.write_text(DRIVER_EXPERIMENT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix", str(store), "--progress", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
                            start_new_session=True)
    policy = CheckpointPolicy(every_steps=40, every_minutes=None)  # the experiment's, where its checkpoints go
    try:
        deadline, periodic, reached = time.time() + 240, None, 0
        while time.time() < deadline and proc.poll() is None:
            runs = list(store.glob("probe/train-*"))
            if runs and (runs[0] / "metrics.jsonl").exists():
                committed = CheckpointManager(str(runs[0]), policy).committed_steps()
                reached = len((runs[0] / "metrics.jsonl").read_text().splitlines())
                # between two periodic checkpoints (a save commits in the background: it may lag), early
                # enough that training cannot end before the host's watch (polling every second) sees it
                if committed and committed[-1] + 2 <= reached <= committed[-1] + 12 and reached <= 200:
                    periodic = committed[-1]
                    proc.send_signal(signal.SIGTERM)
                    break
            time.sleep(0.05)
        assert periodic is not None, proc.communicate(timeout=60)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "marin: stopped by SIGTERM." in err, err
    (run_dir,) = store.glob("probe/train-*")
    record = json.loads((run_dir / ".executor_status").read_text())
    last = record["events"][-1]
    assert last["status"] == "INTERRUPTED", record["events"]
    prefix = "the run was stopped (SIGTERM); training stopped at step "
    assert last["message"].startswith(prefix), last
    final = int(last["message"][len(prefix):].split(":")[0])
    assert last["message"] == f"{prefix}{final}: final checkpoint {run_dir}/checkpoints/step-{final:08d}"
    assert f"      training stopped at step {final}: final checkpoint" in err, err
    assert final >= reached > periodic and final < 400  # the step SIGTERM found, not the last periodic one
    assert CheckpointManager(str(run_dir), policy).committed_steps()[-1] == final
    assert not (run_dir / ".executor_stop").exists()

    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["resumed_from"] == final and summary["final_step"] == 400
    assert [rec["step"] for rec in read_metrics(str(run_dir))] == list(range(1, 401))
    events = [e["status"] for e in json.loads((run_dir / ".executor_status").read_text())["events"]]
    assert events == ["RUNNING", "INTERRUPTED", "RUNNING", "SUCCESS"]


def test_the_watch_takes_the_drivers_stop_request_on_any_thread_and_its_budget(tmp_path):
    """Process 0's watch sees the driver's stop request in the step directory (no signal reaches the
    host): it counts as a stop from the driver, with the request's budget as what is left. In a Ray
    actor the loop runs on the main thread; off it the watch still polls (only the handler needs it)."""
    import threading

    from marin.execution.signals import request_stop

    seen: dict = {}

    def watch_off_the_main_thread() -> None:
        before = signal.getsignal(signal.SIGTERM)
        with PreemptionWatch(60.0, step_dir=str(tmp_path), poll_s=0.02) as watch:
            seen["active"] = watch.active
            request_stop(str(tmp_path), signal.SIGTERM, 12.0)
            deadline = time.monotonic() + 10
            while not watch.requested and time.monotonic() < deadline:
                time.sleep(0.01)
            seen.update(requested=watch.requested, by_driver=watch.by_driver, reason=watch.reason,
                        left=watch.time_left())
        seen["handler_untouched"] = signal.getsignal(signal.SIGTERM) is before

    thread = threading.Thread(target=watch_off_the_main_thread)
    thread.start()
    thread.join(30)
    assert seen["active"] and seen["requested"] and seen["by_driver"] and seen["handler_untouched"], seen
    assert seen["reason"] == "SIGTERM to the driver"
    assert 10 < seen["left"] <= 12  # the request's budget, less the time it may have waited to be seen
    idle = PreemptionWatch(60.0, step_dir=str(tmp_path / "elsewhere"), poll_s=0.02).start()
    time.sleep(0.1)
    assert not idle.requested  # no request in its own directory
    idle.stop()


_TWO_HOSTS = textwrap.dedent(
    """
    import dataclasses, json, sys, threading, time
    import ray
    from ray.cluster_utils import Cluster
    from marin.execution.signals import request_stop
    from marin.training.config import (AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig,
                                       TrainConfig)
    from marin.training.metrics import read_metrics
    from marin.pools import get_pool, launch
    from marin.training.preemption import StopRequested
    from marin.training.trainer import train_on_host

    out = sys.argv[1]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"fake_host": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    config = TrainConfig(output_path=out, pool="local-2host", data=SyntheticDataConfig(vocab_size=512), model="tiny-ep",
                         train_steps=100000, tokens_per_step=512, seq_len_phases=((0.0, 32),),
                         optimizer=AdamWConfig(warmup_steps=1),
                         checkpoint=CheckpointPolicy(every_steps=100000, every_minutes=None, preemption_grace_s=60.0),
                         telemetry=TelemetryConfig(wandb_project=None, progress_every_s=1e9))

    def steps_done():
        try:
            return len(read_metrics(out))
        except FileNotFoundError:  # not started yet
            return 0

    def driver():  # what marin run does on SIGTERM: a stop request in the step directory
        while steps_done() < 3:
            time.sleep(0.05)
        request_stop(out, 15, 55.0)

    threading.Thread(target=driver, daemon=True).start()
    pool = dataclasses.replace(get_pool("local-2host"), max_retries=2)  # a retry would train on and on
    try:
        launch(pool, train_on_host, (config,))
        print("RESULT " + json.dumps({"error": None}))
    except StopRequested as e:
        print("RESULT " + json.dumps({"error": str(e), "steps": [r["step"] for r in read_metrics(out)]}))
    ray.shutdown()
    cluster.shutdown()
    """
)


@pytest.mark.slow  # about 60 s: a simulated 2-node cluster and a 2-process JAX pool
def test_both_hosts_of_a_pool_stop_on_the_drivers_request_with_one_final_checkpoint(tmp_path):
    """Only process 0 reads the stop request; the hosts agree, save one checkpoint together (each
    its own shards) and all raise StopRequested, which the launcher does not retry."""
    script = tmp_path / "two_hosts.py"
    script.write_text(_TWO_HOSTS)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = with_device_count(env.get("XLA_FLAGS", ""), None)
    env.pop("RAY_ADDRESS", None)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(run_dir)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=400)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    import json

    res = json.loads(lines[-1][len("RESULT "):])
    step = res["steps"][-1]
    assert res["error"] == f"training stopped at step {step}: final checkpoint {run_dir}/checkpoints/step-{step:08d}"
    assert res["steps"] == list(range(1, step + 1))  # one attempt: the launcher did not start it again
    manager = CheckpointManager(str(run_dir), _config(run_dir).checkpoint)
    assert manager.committed_steps() == [step]
