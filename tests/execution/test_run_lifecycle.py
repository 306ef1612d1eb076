"""A run's life as a user sees it, in real subprocesses: a prefix that cannot be written, Ctrl-C in the
middle of a step and the resume after it, joining a separately started Ray cluster, and the local
cluster being gone when the run is over."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

EXPERIMENT = textwrap.dedent(
    '''
    import dataclasses, os, time
    from marin.execution import ExecutorStep, executor_main, output_path_of, this_output_path, versioned

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        out: str
        n: int
        inp: str | None = None

    def work(cfg):
        if os.environ.get("TEST_BLOCK") and cfg.n == int(os.environ.get("TEST_BLOCK_STEP", "2")):
            open(os.environ["TEST_BLOCK"], "w").close()
            time.sleep(600)
        with open(os.path.join(cfg.out, "out.txt"), "w") as f:
            f.write(str(cfg.n))

    first = ExecutorStep("first", work, Cfg(this_output_path(), versioned(1)))
    second = ExecutorStep("second", work, Cfg(this_output_path(), versioned(2), output_path_of(first)))
    if __name__ == "__main__":
        executor_main(steps=[second])
    '''
)

# Runs the experiment file in-process and reports whether Ray was ever imported.
DRIVER = (
    "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nfinally:\n"
    "    print('ray imported:', 'ray' in sys.modules)\n"
)


def env_for(tmp_path: Path, **extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
            **extra}


def start_blocked(tmp_path: Path, runner: list[str], **env: str) -> tuple[subprocess.Popen, Path, Path]:
    """Run the chain of :func:`write_experiment` with ``runner`` (the command before the file: ``python``,
    or ``python -m marin.cli run``) into ``tmp_path/store`` and wait until its blocking step has started;
    returns the process (its own session, stdout and stderr piped), the experiment file and the store."""
    exp = write_experiment(tmp_path)
    store, started = tmp_path / "store", tmp_path / "blocked-started"
    proc = subprocess.Popen([*runner, str(exp), "--prefix", str(store), "--progress", "false"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=env_for(tmp_path, TEST_BLOCK=str(started), **env), start_new_session=True)
    deadline = time.time() + 120
    while not started.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert started.exists(), proc.communicate(timeout=30)
    return proc, exp, store


def write_experiment(tmp_path: Path) -> Path:
    """The chain ``first`` -> ``second`` as an experiment file; with ``TEST_BLOCK`` in its environment the
    step numbered ``TEST_BLOCK_STEP`` (default 2, ``second``) creates that file and blocks once started."""
    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT)
    return exp


def run(args: list[str], tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=env_for(tmp_path, **extra), cwd=tmp_path,
                          timeout=240)


def processes_with_marker(marker: str) -> list[str]:
    """``pid: command line`` of each live process whose ``MARIN_TEST_MARKER`` is ``marker``: what a run spawned."""
    from marin.execution.reaper import processes_with_env

    return [f"{pid}: {cmd[:100]}" for pid, cmd in processes_with_env(f"MARIN_TEST_MARKER={marker}").items()]


def test_unwritable_prefix_is_one_line_before_ray_starts_and_the_cluster_ends_with_the_run(tmp_path):
    exp = write_experiment(tmp_path)
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("x")
    # a fresh prefix that cannot be created (a regular file is in the way: fails for root too)
    r = run([sys.executable, "-c", DRIVER, str(exp), "--prefix", str(not_a_dir / "store")], tmp_path)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"marin: error: cannot write under the prefix {not_a_dir}/store (Not a directory: {not_a_dir}/store); "
        "choose a writable --prefix or $MARIN_PREFIX"]
    assert "ray imported: False" in r.stdout
    # a prefix whose steps all succeeded, where the experiment records can no longer be written
    store = tmp_path / "store"
    marker = f"marin-test-{uuid.uuid4().hex}"
    r = run([sys.executable, str(exp), "--prefix", str(store), "--progress", "false"], tmp_path,
            MARIN_TEST_MARKER=marker)
    assert r.returncode == 0, r.stderr
    outputs = {p: p.read_text() for p in store.glob("*/out.txt")}
    assert len(outputs) == 2
    # the local cluster started for the run ended with it, the raylet's agents included
    deadline = time.time() + 5
    while processes_with_marker(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == []
    shutil.rmtree(store / "experiments")
    (store / "experiments").write_text("in the way")
    r = run([sys.executable, "-c", DRIVER, str(exp), "--prefix", str(store)], tmp_path)
    # every step is cached: nothing needs writing, so the run says so and succeeds
    assert r.returncode == 0 and "ray imported: False" in r.stdout, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"Nothing to run: all 2 steps already succeeded under {store}", lines
    assert lines[1].startswith(f"(the experiment record was not updated: cannot write under {store}: "), lines
    assert {p: p.read_text() for p in store.glob("*/out.txt")} == outputs


@pytest.mark.slow  # 85 s on the loaded 2-core VM; SIGTERM takes the same stop path, and its test (interrupted
# record, released lease, the rerun resuming) stays in the default run: test_signals.py
def test_ctrl_c_marks_the_running_step_interrupted_and_the_next_run_resumes_it(tmp_path):
    proc, exp, store = start_blocked(tmp_path, [sys.executable])
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    (second,) = store.glob("second-*")
    (first,) = store.glob("first-*")
    assert "marin: interrupted (Ctrl-C)." in err and f"  second ({second})" in err
    assert "1 step(s) finished in this run and are kept" in err and "To resume, run the same command again:" in err
    status = json.loads((second / ".executor_status").read_text())
    assert status["status"] == "INTERRUPTED"
    lease = json.loads((second / ".executor_lease").read_text())
    assert lease["released"] is True
    assert (first / "out.txt").read_text() == "1"
    # the next run resumes the interrupted step without --force_run_failed and keeps the finished one
    r = run([sys.executable, str(exp), "--prefix", str(store), "--progress", "false"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1 cached" in r.stderr and "1 succeeded" in r.stderr
    assert (second / "out.txt").read_text() == "2"
    events = [e["status"] for e in json.loads((second / ".executor_status").read_text())["events"]]
    assert events == ["RUNNING", "INTERRUPTED", "RUNNING", "SUCCESS"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_address_joins_a_cluster_started_with_token_authentication(tmp_path):
    """`ray start --head` with Ray's secure default, then `marin run --address`: the token is used when
    this machine has one, and a machine without one is told in one line what to set."""
    import shutil
    import tempfile

    from marin.execution.reaper import descendants, still_running

    exp = write_experiment(tmp_path)
    home, empty_home = tmp_path / "home", tmp_path / "empty-home"
    home.mkdir()
    empty_home.mkdir()
    base = {k: v for k, v in env_for(tmp_path).items() if not k.startswith("RAY_AUTH")}
    ray_bin = str(Path(sys.executable).parent / "ray")
    subprocess.run([ray_bin, "get-auth-token", "--generate"], env={**base, "HOME": str(home)}, check=True,
                   capture_output=True, timeout=120)
    assert (home / ".ray" / "auth_token").exists()
    port, temp_dir = _free_port(), tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's socket paths
    head_log = tmp_path / "head.log"
    with open(head_log, "w") as log:
        head = subprocess.Popen([ray_bin, "start", "--head", "--port", str(port), "--temp-dir", temp_dir,
                                 "--include-dashboard", "false", "--num-cpus", "2", "--block"],
                                env={**base, "HOME": str(home)}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while "--block" not in head_log.read_text() and time.time() < deadline and head.poll() is None:
            time.sleep(0.5)
        assert "Token authentication is enabled" in head_log.read_text(), head_log.read_text()
        address = f"127.0.0.1:{port}"
        marin_run = [sys.executable, "-m", "marin.cli", "run", str(exp), "--address", address, "--progress", "false"]
        r = subprocess.run([*marin_run, "--prefix", str(tmp_path / "store")], env={**base, "HOME": str(home)},
                           cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr
        assert sorted(p.read_text() for p in (tmp_path / "store").glob("*/out.txt")) == ["1", "2"]
        r = subprocess.run([*marin_run, "--prefix", str(tmp_path / "other")], env={**base, "HOME": str(empty_home)},
                           cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert r.returncode == 1
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"marin: error: could not join the Ray cluster at {address}") and \
            "~/.ray/auth_token" in last and "RAY_AUTH_TOKEN" in last, r.stderr
        assert not list((tmp_path / "other").glob("*/out.txt"))
    finally:
        spawned = descendants(head.pid)
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
        for proc in spawned:
            if still_running(proc):  # same pid and start time: still the process the cluster started
                os.kill(proc[0], signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
