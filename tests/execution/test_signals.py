"""SIGTERM (what schedulers send on preemption) and SIGHUP (a closed terminal) to a real ``marin run``
process in the middle of a step: handled like Ctrl-C, with the signal named and the shell's exit status."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from test_run_lifecycle import env_for, run, write_experiment


def _start_and_signal(tmp_path, sig: int) -> tuple[subprocess.Popen, str]:
    exp = write_experiment(tmp_path)
    store, started = tmp_path / "store", tmp_path / "second-started"
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix", str(store),
                             "--progress", "false"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=env_for(tmp_path, TEST_BLOCK=str(started)), start_new_session=True)
    deadline = time.time() + 120
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert started.exists(), proc.communicate(timeout=30)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=90)
    return proc, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGHUP"])  # SIGHUP takes the same path (slow set)
def test_stop_signal_marks_the_step_interrupted_names_the_signal_and_the_rerun_resumes(tmp_path, sig):
    proc, err = _start_and_signal(tmp_path, sig)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err  # 143 for SIGTERM, 129 for SIGHUP
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    store = tmp_path / "store"
    (second,) = store.glob("second-*")
    assert f"marin: stopped by {name}." in err
    assert f"  second ({second})" in err and "To resume, run the same command again:" in err
    status = json.loads((second / ".executor_status").read_text())
    assert status["status"] == "INTERRUPTED"
    assert status["events"][-1]["message"] == f"the run was stopped ({name})"
    assert status["info"]["name"] == "second"  # what the step is survives the stop
    assert json.loads((second / ".executor_lease").read_text())["released"] is True
    # marin status shows it under its own name, and says what to do
    r = run([sys.executable, "-m", "marin.cli", "status", "--prefix", str(store)], tmp_path)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("second "))
    assert "INTERRUPTED" in row
    if sig == signal.SIGTERM:  # the rerun resumes without --force_run_failed
        r = run([sys.executable, "-m", "marin.cli", "run", str(tmp_path / "exp.py"), "--prefix", str(store),
                 "--progress", "false"], tmp_path)
        assert r.returncode == 0, r.stderr
        assert (second / "out.txt").read_text() == "2"
        events = [e["status"] for e in json.loads((second / ".executor_status").read_text())["events"]]
        assert events == ["RUNNING", "INTERRUPTED", "RUNNING", "SUCCESS"]


CHAIN = '''
import dataclasses, os, time
from marin.execution import ExecutorStep, executor_main, output_path_of, this_output_path, versioned

@dataclasses.dataclass(frozen=True)
class Cfg:
    out: str
    n: int
    inp: str | None = None

def work(cfg):
    if cfg.n == 1:
        open(os.environ["TEST_BLOCK"], "w").close()
        time.sleep(600)

first = ExecutorStep("first", work, Cfg(this_output_path(), versioned(1)))
second = ExecutorStep("second", work, Cfg(this_output_path(), versioned(2), output_path_of(first)))
if __name__ == "__main__":
    executor_main(steps=[second])
'''


def test_a_step_queued_behind_its_upstream_reads_queued_and_a_stop_interrupts_both(tmp_path):
    (tmp_path / "exp.py").write_text(CHAIN)
    store, started = tmp_path / "store", tmp_path / "first-started"
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(tmp_path / "exp.py"), "--prefix",
                             str(store), "--progress", "false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env_for(tmp_path, TEST_BLOCK=str(started)),
                            start_new_session=True)
    deadline = time.time() + 120
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert started.exists(), proc.communicate(timeout=30)
    try:
        r = run([sys.executable, "-m", "marin.cli", "status", "--prefix", str(store)], tmp_path)
        rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith(("first ", "second "))}
        assert "RUNNING" in rows["first"] and "QUEUED" not in rows["first"], r.stdout
        assert "QUEUED (waiting for first)" in rows["second"], r.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err
    for name in ("first", "second"):
        (d,) = store.glob(f"{name}-*")
        assert json.loads((d / ".executor_status").read_text())["status"] == "INTERRUPTED"


def test_sigterm_while_ray_starts_is_a_clean_stop(tmp_path):
    from test_run_lifecycle import _processes_with_marker

    exp = write_experiment(tmp_path)
    marker = f"marin-test-{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix", str(tmp_path / "store"),
                             "--progress", "false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=env_for(tmp_path, MARIN_TEST_MARKER=marker), start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # the first Ray process: the cluster is starting
        if any("gcs_server" in p for p in _processes_with_marker(marker)):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "marin: stopped by SIGTERM." in err, err
    assert "No step was running." in err, err  # it arrived before any step started: while Ray started
    deadline = time.time() + 10
    while _processes_with_marker(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert _processes_with_marker(marker) == []  # the half-started cluster is gone too
