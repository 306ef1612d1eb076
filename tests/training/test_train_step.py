"""Training as an executor step: default_train -> executor -> Ray pool launcher -> trainer."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from marin.execution import ExecutorMainConfig, executor_main
from marin.execution.status import current_status, read_info, read_status
from marin.models.config import get_preset
from marin.pools import with_device_count
from marin.training.checkpoint import read_checkpoint
from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig
from marin.training.metrics import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _step(name="train/tiny-ep", lr_replans=()):
    from experiments.defaults import default_train

    return default_train(
        name,
        mixture=SyntheticDataConfig(vocab_size=512),
        # one layer: XLA drops a one-step scan's loop, so the host's train step compiles in about 2/3 of
        # the 4-layer time; nothing here depends on depth
        model=get_preset("tiny-ep", n_layers=1),
        pool="local-cpu",
        train_steps=6,
        tokens_per_step=1024,
        seq_len_phases=((0.0, 32),),
        optimizer=AdamWConfig(warmup_steps=1, peak_lr=1e-2, lr_replans=lr_replans),
        checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None),
        telemetry=TelemetryConfig(wandb_project=None),
    )


def test_default_train_runs_as_executor_step(ray_local, tmp_path):
    step = _step()
    result = executor_main(ExecutorMainConfig(prefix=str(tmp_path), progress=False), steps=[step])
    [(path, outcome)] = result.outcome.items()
    assert outcome == "succeeded", result.errors
    assert current_status(read_status(path)).value == "SUCCESS"
    records = read_metrics(path)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(r["transport"] == "fixed" for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    final, meta = read_checkpoint(f"{path}/checkpoints/step-00000006")
    assert meta["tokens"] == 6 * 1024
    # review: `marin show` of a training step summarises its telemetry against healthy ranges
    from marin.review import show

    shown = show(path)
    assert shown["status"] == "SUCCESS" and "metrics.jsonl" in shown["outputs"]
    assert shown["health"]["summary"]["last_step"] == 6
    assert {c["name"] for c in shown["health"]["checks"]} >= {"finite", "loss_falling", "drop_send", "drop_recv"}
    # re-planning the horizon does not change the step's identity (same output path)
    replanned = _step(lr_replans=((3, 5),))
    from marin.execution import plan_steps

    assert plan_steps([replanned], str(tmp_path)).steps[0].output_path == path


_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from experiments.defaults import default_train
    from marin.execution import executor_main
    from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig

    step = default_train(
        "train/killme", mixture=SyntheticDataConfig(vocab_size=512), model="tiny-ep", pool="local-cpu",
        train_steps={steps}, tokens_per_step=1024, seq_len_phases=((0.0, 32),),
        optimizer=AdamWConfig(warmup_steps=1, peak_lr={lr}),
        checkpoint=CheckpointPolicy(every_steps=2, every_minutes=None), telemetry=TelemetryConfig(wandb_project=None),
    )
    if __name__ == "__main__":
        executor_main(steps=[step])
    """
)


def _run_script(tmp_path, prefix, steps=10, lr=1e-2, wait_for=None, extra=()):
    script = tmp_path / "exp.py"
    script.write_text(_SCRIPT.format(repo=REPO, steps=steps, lr=lr))
    env = dict(os.environ, XLA_FLAGS=with_device_count(os.environ.get("XLA_FLAGS", ""), 8), RAY_USAGE_STATS_ENABLED="0",
               WANDB_MODE="offline", PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, str(script), "--prefix", str(prefix), *extra]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if wait_for is None:
        out, _ = proc.communicate(timeout=600)
        return proc.returncode, out.decode(errors="replace")
    deadline = time.time() + 600
    while time.time() < deadline and not wait_for():
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode(errors="replace"))
        time.sleep(0.2)
    # SIGKILL the driver, Ray and the training host: the whole session, no cleanup anywhere.
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return None, ""


def _step_dir(prefix):
    [d] = [p for p in (prefix / "train").iterdir() if p.name.startswith("killme-")]
    return d


@pytest.mark.slow  # three `marin run` processes of 40 steps, each with its own Ray; its core, a crash after a
# checkpoint resuming bitwise: test_trainer.py's test_crash_and_resume_is_bitwise_identical
def test_sigkill_then_rerun_resumes_bitwise(tmp_path):
    # 40 steps, a checkpoint every 2 (the last 2 kept): a kill after the first checkpoint at or past
    # step 4 lands well before the end, however fast the machine (polling cannot miss the window).
    steps = 40
    clean_prefix, killed_prefix = tmp_path / "clean", tmp_path / "killed"
    rc, out = _run_script(tmp_path, clean_prefix, steps=steps)
    assert rc == 0, out

    def has_a_checkpoint_past_step_4():
        try:
            commits = (_step_dir(killed_prefix) / "checkpoints").glob("*/COMMIT")
            done = [int(c.parent.name.split("-")[1]) for c in commits]
        except (FileNotFoundError, ValueError):
            return False
        return any(4 <= d < steps for d in done)

    _run_script(tmp_path, killed_prefix, steps=steps, wait_for=has_a_checkpoint_past_step_4)
    killed_dir = _step_dir(killed_prefix)
    assert current_status(read_status(str(killed_dir))).value == "RUNNING"  # died without a word
    assert not (killed_dir / "checkpoints" / f"step-{steps:08d}").exists()
    rc, out = _run_script(tmp_path, killed_prefix, steps=steps)
    assert rc == 0, out
    assert current_status(read_status(str(killed_dir))).value == "SUCCESS"
    assert json.loads((killed_dir / "train_summary.json").read_text())["resumed_from"] >= 4

    a, _ = read_checkpoint(str(_step_dir(clean_prefix) / "checkpoints" / f"step-{steps:08d}"))
    b, _ = read_checkpoint(str(killed_dir / "checkpoints" / f"step-{steps:08d}"))
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), f"leaf {k} differs after resume"
    assert [r["step"] for r in read_metrics(str(killed_dir))] == list(range(1, steps + 1))


@pytest.mark.slow  # a `marin run` process with its own Ray; its core, the NaN guard's error
# (test_trainer.py) and a failing step's reason in its record (test_faults_cli.py)
def test_divergence_marks_step_failed_with_reason(tmp_path):
    rc, out = _run_script(tmp_path, tmp_path / "p", steps=6, lr=1e30)
    assert rc != 0
    step_dir = _step_dir(tmp_path / "p")
    status = read_status(str(step_dir))
    assert current_status(status).value == "FAILED"
    text = json.dumps(status) + json.dumps(read_info(str(step_dir)) or {})
    assert "TrainingDiverged" in text and "non-finite training signal at step" in text
