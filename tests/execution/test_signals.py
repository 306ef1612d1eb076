"""SIGTERM (what schedulers send on preemption) and SIGHUP (a closed terminal) to a real ``marin run``
process in the middle of a step: handled like Ctrl-C, with the signal named and the shell's exit status."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run_lifecycle import env_for, run, start_blocked, write_experiment

from marin.execution import ExecutorMainConfig, ExecutorStep, executor_main, this_output_path, versioned
from marin.execution.failures import StopRequested
from marin.execution.plan import plan_steps
from marin.execution.signals import read_stop_request, request_stop


def _start_and_signal(tmp_path, sig: int) -> tuple[subprocess.Popen, str]:
    proc, _, _ = start_blocked(tmp_path, [sys.executable, "-m", "marin.cli", "run"])
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


def test_a_dependent_waits_unsubmitted_for_its_running_upstream_and_a_stop_interrupts_the_upstream(tmp_path):
    """``second`` is submitted only after ``first``'s SUCCESS: while ``first`` runs, ``second`` has no
    record at all (no lease, nothing in Ray's queue); a stop interrupts ``first`` and leaves ``second``
    for the next run."""
    from test_run_lifecycle import processes_with_marker

    exp = write_experiment(tmp_path)  # the chain first -> second, here blocking in first
    store, started = tmp_path / "store", tmp_path / "first-started"
    marker = f"marin-test-{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix",
                             str(store), "--progress", "false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, start_new_session=True,
                            env=env_for(tmp_path, TEST_BLOCK=str(started), TEST_BLOCK_STEP="1",
                                        MARIN_TEST_MARKER=marker))
    deadline = time.time() + 120
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert started.exists(), proc.communicate(timeout=30)
    try:
        r = run([sys.executable, "-m", "marin.cli", "status", "--prefix", str(store)], tmp_path)
        rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith(("first ", "second "))}
        assert "RUNNING" in rows["first"] and "QUEUED" not in rows["first"], r.stdout
        assert "second" not in rows and not list(store.glob("second-*")), r.stdout
    finally:
        _burst(proc)  # as a scheduler sends them: fifty within a second, one clean stop
        _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.count("marin: stopped by SIGTERM") == 1, err
    (d,) = store.glob("first-*")
    assert json.loads((d / ".executor_status").read_text())["status"] == "INTERRUPTED"
    assert not list(store.glob("second-*"))
    from marin.execution.experiment_record import experiment_record_paths, read_experiment_record

    (experiment,) = experiment_record_paths(str(store))
    outcomes = {s["name"]: s["outcome"] for s in read_experiment_record(experiment)["steps"]}
    assert outcomes["first"] == "interrupted", outcomes
    deadline = time.time() + 10
    while processes_with_marker(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == []  # nothing of the cluster left behind


@pytest.mark.slow  # the same moment, fifty signals instead of one: the default run's fifty-SIGTERMs test [starting]
def test_sigterm_while_ray_starts_is_a_clean_stop(tmp_path):
    from test_run_lifecycle import processes_with_marker

    exp = write_experiment(tmp_path)
    marker = f"marin-test-{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix", str(tmp_path / "store"),
                             "--progress", "false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=env_for(tmp_path, MARIN_TEST_MARKER=marker), start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # the first Ray process: the cluster is starting
        if any("gcs_server" in p for p in processes_with_marker(marker)):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "marin: stopped by SIGTERM." in err, err
    assert "No step was running." in err, err  # it arrived before any step started: while Ray started
    deadline = time.time() + 10
    while processes_with_marker(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == []  # the half-started cluster is gone too


GRACEFUL = '''
import dataclasses, os, time
from marin.execution import ExecutorStep, executor_main, this_output_path, versioned
from marin.execution.failures import StopRequested
from marin.execution.signals import read_stop_request

@dataclasses.dataclass(frozen=True)
class Cfg:
    out: str
    n: int
    heed: bool = True

def work(cfg):
    """Counts units of work; one that heeds the driver's stop request saves its count and stops."""
    open(os.path.join(cfg.out, "started"), "w").close()
    n = 0
    while True:
        n += 1
        with open(os.path.join(cfg.out, "progress.txt"), "w") as f:
            f.write(str(n))
        if cfg.heed and read_stop_request(cfg.out) is not None:
            with open(os.path.join(cfg.out, "saved.txt"), "w") as f:
                f.write(str(n))
            raise StopRequested(f"saved unit {n} and stopped")
        time.sleep(0.1)

free = {"num_cpus": 0}
heeds = ExecutorStep("heeds", work, Cfg(this_output_path(), versioned(1)), resources=free, stop_grace_s=30)
deaf = ExecutorStep("deaf", work, Cfg(this_output_path(), versioned(2), heed=False), resources=free, stop_grace_s=6)
plain = ExecutorStep("plain", work, Cfg(this_output_path(), versioned(3), heed=False), resources=free)
if __name__ == "__main__":
    executor_main(steps=[heeds, deaf, plain])
'''


def _start_graceful(tmp_path) -> subprocess.Popen:
    """``marin run`` of :data:`GRACEFUL`, once its three steps are working."""
    (tmp_path / "exp.py").write_text(GRACEFUL)
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(tmp_path / "exp.py"), "--prefix",
                             str(store), "--progress", "false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env_for(tmp_path), start_new_session=True)
    deadline = time.time() + 120
    while len(list(store.glob("*/started"))) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert len(list(store.glob("*/started"))) == 3, proc.communicate(timeout=30)
    return proc


def test_sigterm_gives_steps_with_a_grace_period_time_to_save_and_stop(tmp_path):
    """A step with a grace period gets the driver's stop request and stops by itself (its note in
    the record); one that ignores it is cancelled when its grace period is up; one without a grace
    period is cancelled at once, as before."""
    proc, store = _start_graceful(tmp_path), tmp_path / "store"
    signalled = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    took = time.time() - signalled
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "marin: stopped by SIGTERM." in err, err
    assert "stopping (SIGTERM): 2 step(s) may take up to 30s to save their work and stop" in err, err
    (heeds,), (deaf,), (plain,) = (list(store.glob(f"{n}-*")) for n in ("heeds", "deaf", "plain"))
    saved = (heeds / "saved.txt").read_text()
    messages = {d.name.split("-")[0]: json.loads((d / ".executor_status").read_text())["events"][-1]
                for d in (heeds, deaf, plain)}
    assert {n: m["status"] for n, m in messages.items()} == dict.fromkeys(("heeds", "deaf", "plain"), "INTERRUPTED")
    assert messages["heeds"]["message"] == f"the run was stopped (SIGTERM); saved unit {saved} and stopped"
    assert f"  heeds ({heeds})\n      saved unit {saved} and stopped" in err, err
    assert messages["deaf"]["message"] == ("the run was stopped (SIGTERM); it did not stop within its 6s grace "
                                           "period and was cancelled")
    assert messages["plain"]["message"] == "the run was stopped (SIGTERM)"
    assert 6 <= took < 40, took  # the deaf step's grace period, then the records
    # the plain step was cancelled at once; the deaf one kept working through its grace period
    assert (plain / "progress.txt").stat().st_mtime < signalled + 3
    assert (deaf / "progress.txt").stat().st_mtime > signalled + 4
    assert not (heeds / ".executor_stop").exists() and not (deaf / ".executor_stop").exists()


def test_a_second_ctrl_c_cuts_the_grace_period_short(tmp_path):
    proc, store = _start_graceful(tmp_path), tmp_path / "store"
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    again = time.time()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "; Ctrl-C again stops them at once" in err and "marin: interrupted (Ctrl-C)." in err, err
    (deaf,) = store.glob("deaf-*")
    last = json.loads((deaf / ".executor_status").read_text())["events"][-1]
    assert last["message"] == "the run was stopped (Ctrl-C); it was cancelled by a second Ctrl-C"
    assert (deaf / "progress.txt").stat().st_mtime < again + 3  # not left to work through its 6 s grace


@dataclasses.dataclass(frozen=True)
class HeedCfg:
    out: str
    n: int


def stops_when_asked(cfg: HeedCfg) -> None:
    if read_stop_request(cfg.out) is not None:
        raise StopRequested("stopped on the driver's request")
    (Path(cfg.out) / "out.txt").write_text(str(cfg.n))


def test_a_stop_request_a_killed_driver_left_is_cleared_before_the_step_starts(tmp_path, ray_local):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    heeds = ExecutorStep("heeds", stops_when_asked, HeedCfg(this_output_path(), versioned(1)), stop_grace_s=30)
    (path,) = (s.output_path for s in plan_steps([heeds], str(tmp_path / "store")).steps)
    os.makedirs(path)
    request_stop(path, signal.SIGTERM, 25.0)  # the driver that wrote it was SIGKILLed while it waited
    result = executor_main(ExecutorMainConfig(prefix=str(tmp_path / "store"), progress=False), steps=[heeds])
    assert result.outcome[path] == "succeeded"
    assert (Path(path) / "out.txt").read_text() == "1" and not (Path(path) / ".executor_stop").exists()


ENDING = '''
import dataclasses, os
from marin.execution import ExecutorStep, executor_main, this_output_path, versioned

@dataclasses.dataclass(frozen=True)
class Cfg:
    out: str
    n: int

def work(cfg):
    if os.environ.get("TEST_FAIL"):
        raise ValueError("the step's own error")
    with open(os.path.join(cfg.out, "out.txt"), "w") as f:
        f.write(str(cfg.n))

only = ExecutorStep("only", work, Cfg(this_output_path(), versioned(1)))
if __name__ == "__main__":
    executor_main(steps=[only])
'''


# 52 s each on the loaded 2-core VM; a failed run shuts its cluster down through the same path (slow set)
@pytest.mark.parametrize("outcome", ["SUCCESS", pytest.param("FAILED", marks=pytest.mark.slow)])
def test_a_stop_signal_while_ray_stops_is_a_clean_stop_and_the_records_are_intact(tmp_path, outcome):
    """SIGTERM sent again and again from the moment the driver's shutdown of the cluster is seen to
    begin (its raylet is gone) until the driver exits: no traceback, the step's record untouched, the
    experiment record complete, the signal's exit status, and no process of the cluster left behind.
    After a failure too (the cleanup of a failed run)."""
    from test_run_lifecycle import processes_with_marker

    (tmp_path / "exp.py").write_text(ENDING)
    store, marker = tmp_path / "store", f"marin-test-{time.time_ns()}"
    extra = {"MARIN_TEST_MARKER": marker, **({"TEST_FAIL": "1"} if outcome == "FAILED" else {})}
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(tmp_path / "exp.py"), "--prefix",
                             str(store), "--progress", "false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env_for(tmp_path, **extra), start_new_session=True)
    deadline = time.time() + 120
    status = None
    while time.time() < deadline and proc.poll() is None:
        found = list(store.glob("only-*/.executor_status"))
        status = json.loads(found[0].read_text())["status"] if found else None
        if status == outcome:
            break
        time.sleep(0.01)
    assert status == outcome, proc.communicate(timeout=30)
    # the raylet exits early in the driver's shutdown of the cluster, which then takes about 2 s more
    # (the GCS, the agents, waiting for each): from then on every signal lands inside the shutdown
    while proc.poll() is None and any("raylet" in p for p in processes_with_marker(marker)):
        time.sleep(0.005)
    sent = 0
    while proc.poll() is None and sent < 2000:  # across the whole shutdown, until the driver exits
        proc.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.005)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "marin: stopped by SIGTERM while stopping the Ray cluster, after every step had ended." in err, err
    (step_dir,) = store.glob("only-*")
    record = json.loads((step_dir / ".executor_status").read_text())
    assert [e["status"] for e in record["events"]] == ["RUNNING", outcome]
    from marin.execution.experiment_record import experiment_record_paths, read_experiment_record

    (experiment,) = experiment_record_paths(str(store))
    expected = "succeeded" if outcome == "SUCCESS" else "failed"
    assert [s["outcome"] for s in read_experiment_record(experiment)["steps"]] == [expected]
    if outcome == "SUCCESS":
        assert (step_dir / "out.txt").read_text() == "1"
        assert "1 step(s) finished in this run and are kept" in err and "To resume" not in err, err
    else:
        assert f"1 step(s) failed (see why with `marin show PATH`; rerun one with --retry_failed STEP):\n" \
               f"  only ({step_dir}): ValueError: the step's own error" in err, err
    deadline = time.time() + 10
    while processes_with_marker(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == []


def _burst(proc: subprocess.Popen, count: int = 50, within_s: float = 1.0) -> None:
    """``count`` SIGTERMs spread over ``within_s`` seconds, as a scheduler (or an impatient operator) sends them."""
    for _ in range(count):
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        time.sleep(within_s / count)


# each phase starts a local cluster (~10-20 s on the 2-core VM): the start runs by default; a running
# step (the dependent test above sends the same fifty), the shutdown (covered above with 2,000 signals)
# and SUCCESS in the slow set
@pytest.mark.parametrize("phase", ["starting", pytest.param("running", marks=pytest.mark.slow),
                                   pytest.param("writing SUCCESS", marks=pytest.mark.slow),
                                   pytest.param("stopping the cluster", marks=pytest.mark.slow)])
def test_fifty_sigterms_within_a_second_at_any_phase_are_one_clean_stop(tmp_path, phase):
    """However many signals arrive, the stop runs once: the signal's exit status, one message and no
    traceback, every record whole, nothing of the cluster left behind."""
    from test_run_lifecycle import processes_with_marker

    (tmp_path / "exp.py").write_text(ENDING)
    store, marker, started = tmp_path / "store", f"marin-test-{time.time_ns()}", tmp_path / "started"
    extra = {"MARIN_TEST_MARKER": marker}
    if phase == "running":
        write_experiment(tmp_path)  # a chain whose second step blocks once it has started
        extra["TEST_BLOCK"] = str(started)
    proc = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(tmp_path / "exp.py"), "--prefix",
                             str(store), "--progress", "false"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env_for(tmp_path, **extra), start_new_session=True)

    def status() -> str | None:
        found = sorted(store.glob("*-*/.executor_status"))
        return json.loads(found[-1].read_text())["status"] if found else None

    reached = {
        "starting": lambda: any("gcs_server" in p for p in processes_with_marker(marker)),
        "running": started.exists,
        "writing SUCCESS": lambda: status() == "SUCCESS",
        "stopping the cluster": lambda: status() == "SUCCESS" and not any(
            "raylet" in p for p in processes_with_marker(marker)),
    }[phase]
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not reached():
        time.sleep(0.005)
    assert proc.poll() is None and reached(), proc.communicate(timeout=30)
    _burst(proc)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.count("marin: stopped by SIGTERM") == 1, err
    if phase == "starting":  # they arrived before any step started: while Ray started
        assert "marin: stopped by SIGTERM.\nNo step was running." in err, err
    from marin.execution.experiment_record import experiment_record_paths, read_experiment_record

    records = {p.name.rsplit("-", 1)[0]: json.loads((p / ".executor_status").read_text())
               for p in store.glob("*-*") if (p / ".executor_status").exists()}
    for name, record in records.items():  # every record whole: finished or stopped, never left RUNNING
        assert record["status"] in ("SUCCESS", "INTERRUPTED"), (name, record)
    if phase == "running":
        assert records["second"]["status"] == "INTERRUPTED" and records["first"]["status"] == "SUCCESS"
    if phase in ("writing SUCCESS", "stopping the cluster"):
        assert [e["status"] for e in records["only"]["events"]] == ["RUNNING", "SUCCESS"]
        assert (next(store.glob("only-*")) / "out.txt").read_text() == "1"
    if phase != "starting":
        (experiment,) = experiment_record_paths(str(store))
        outcomes = {s["name"]: s["outcome"] for s in read_experiment_record(experiment)["steps"]}
        assert all(outcomes[name] == ("succeeded" if r["status"] == "SUCCESS" else "interrupted")
                   for name, r in records.items()), outcomes
    deadline = time.time() + 10
    while processes_with_marker(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == []


FORK_HANDLER_STOP = """
import os, signal, sys, time
from marin.execution.signals import RunStopped, StopSignals

# a signal whose handler runs inside a fork handler, where Python only prints what it raises
os.register_at_fork(after_in_parent=lambda: signal.raise_signal(signal.SIGTERM))
with StopSignals() as signals:
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        deadline = time.time() + 30
        while time.time() < deadline:
            time.sleep(0.01)
        print("not stopped")
    except RunStopped as e:
        print("stopped after the fork by", signal.Signals(e.signum).name)
"""


def test_a_stop_signal_landing_in_a_fork_handler_still_stops_the_run(tmp_path):
    """A local cluster's start forks its processes, and ``logging``'s fork handlers run at each fork: a
    stop raised in one was printed as ignored and lost (the run went on to its end). It is raised again
    after the fork, and nothing is printed."""
    script = tmp_path / "fork_stop.py"  # a file: run with -c, Python raised it from the fork itself
    script.write_text(FORK_HANDLER_STOP)
    r = run([sys.executable, str(script)], tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "stopped after the fork by SIGTERM", r.stdout + r.stderr
    assert r.stderr == "", r.stderr
