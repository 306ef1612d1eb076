"""The watchdog a local Ray cluster starts with: when its driver is killed outright (no code of the
driver runs), what the cluster left is stopped, not left to Ray's agents' own polling (a minute or
two); when the driver stopped its cluster itself, the watchdog touches nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from marin.execution.reaper import REAPER_SCRIPT, STOPPED, descendants, still_running

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
"""A driver whose child (an agent of its cluster) outlives it unless someone stops it."""


def _driver_and_watchdog():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER])
    while not descendants(driver.pid):  # its agent has started
        time.sleep(0.05)
    [agent] = descendants(driver.pid)
    read, write = os.pipe()
    # started as the driver starts it: the file alone, on the standard library
    watchdog = subprocess.Popen([sys.executable, "-I", "-S", REAPER_SCRIPT, str(driver.pid), "1"], stdin=read,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    os.close(read)
    assert watchdog.stdout.readline() == "watching\n"  # it has noted the agent
    return driver, agent, watchdog, write


def test_a_driver_killed_outright_has_what_it_left_stopped():
    driver, agent, watchdog, write = _driver_and_watchdog()
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert still_running(agent)  # orphaned: nothing of the driver ran
    os.close(write)  # as the kernel does when the driver dies
    _, err = watchdog.communicate(timeout=60)
    assert err == (f"marin: the driver (pid {driver.pid}) died without stopping its local Ray cluster; stopped 1 "
                   f"process(es) it left: {agent[0]}\n")
    assert not still_running(agent)


def test_a_driver_that_stopped_its_cluster_itself_has_nothing_touched():
    driver, agent, watchdog, write = _driver_and_watchdog()
    os.write(write, STOPPED)
    os.close(write)
    _, err = watchdog.communicate(timeout=60)
    assert watchdog.returncode == 0 and err == ""
    try:
        assert still_running(agent)
    finally:
        os.kill(agent[0], signal.SIGKILL)
        driver.kill()
        driver.wait()


EXPERIMENT = """
import dataclasses, sys, time
from marin.execution import ExecutorStep, executor_main, this_output_path

@dataclasses.dataclass(frozen=True)
class Cfg:
    out: str

def slow(cfg):
    print("step started", file=sys.stderr, flush=True)
    time.sleep(300)

if __name__ == "__main__":
    executor_main(steps=[ExecutorStep("slow", slow, Cfg(this_output_path()))])
"""


@pytest.mark.slow
def test_marin_run_killed_outright_leaves_no_ray_process_behind(tmp_path):
    """A real local cluster: its GCS and raylet share the driver's fate, its dashboard and runtime-env
    agents and the step's worker are stopped by the watchdog (Ray's agents would poll for a minute
    or two; the deadline below is well short of that and far above the watchdog's second)."""
    exp = tmp_path / "exp.py"
    exp.write_text(EXPERIMENT)
    env = {**os.environ, "PYTHONPATH": REPO}
    run = subprocess.Popen([sys.executable, "-m", "marin.cli", "run", str(exp), "--prefix", str(tmp_path / "p"),
                            "--progress", "false"], stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                           start_new_session=True)
    lines = []
    for line in run.stderr:
        lines.append(line)
        if "step started" in line:
            break
    left = descendants(run.pid)  # the cluster's processes, the step's worker and the watchdog
    assert len(left) >= 4, left
    run.kill()
    run.wait()
    rest = run.stderr.read()
    deadline = time.monotonic() + 30
    while [p for p in left if still_running(p)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in left if still_running(p)], "".join(lines) + rest
