"""The stall watchdog: the detection rule as pure functions, and the launcher killing and relaunching a
pool whose only host was stopped with SIGSTOP (a real hang: the process is frozen by the kernel)."""

import json
import os
import signal
import sys
import time

import pytest
import ray.cloudpickle

from marin.execution.failures import is_infrastructure_failure
from marin.pools import PoolLostError, PoolSpec, launch
from marin.pools.stall import (
    HostProgress,
    PoolStalled,
    StallRule,
    find_stall,
    observe,
    report_phase,
    report_step,
    step_timeout,
)


# ---- the rule, pure ----------------------------------------------------------------------------------
def test_step_timeout_is_the_explicit_one_or_ten_times_the_median_with_a_floor():
    assert step_timeout(StallRule(timeout_s=42.0), [1.0, 2.0]) == 42.0
    assert step_timeout(StallRule(), []) == 600.0  # nothing measured yet: the floor
    # the median, computed the slow obvious way: the middle of the sorted list (even: the mean of the two)
    times = [20.0, 19.0, 300.0, 21.0, 20.5]  # one slow step (a checkpoint wait) does not move it
    middle = sorted(times)[len(times) // 2]
    assert step_timeout(StallRule(floor_s=1.0), times) == 10 * middle == 205.0
    assert step_timeout(StallRule(floor_s=1.0, factor=3.0), [1.0, 2.0, 3.0, 4.0]) == 3 * (2.0 + 3.0) / 2
    assert step_timeout(StallRule(), [0.1] * 5) == 600.0  # a tiny step: the floor holds
    with pytest.raises(ValueError, match="stall.timeout_s must be > 0"):
        StallRule(timeout_s=0)


def _host(process, step, *, advanced, heard, phase="train"):
    return HostProgress(process, step=step, phase=phase, advanced_at=advanced, heard_at=heard, beats=1,
                        pid=100 + process, node="10.0.0.1")


def test_no_stall_while_steps_complete_within_the_timeout():
    rule = StallRule(timeout_s=60.0)
    hosts = [_host(0, 10, advanced=100.0, heard=155.0), _host(1, 10, advanced=100.0, heard=158.0)]
    assert find_stall(hosts, num_hosts=2, started_at=0.0, now=159.0, rule=rule) is None
    assert find_stall(hosts, num_hosts=2, started_at=0.0, now=161.0, rule=rule) is not None


def test_a_silent_host_is_named_and_a_waiting_one_is_not():
    rule = StallRule(timeout_s=60.0)  # beats every 5 s: silent after 15 s
    stopped = _host(1, 10, advanced=100.0, heard=101.0)  # SIGSTOPped right after step 10
    waiting = _host(0, 10, advanced=100.0, heard=170.0)  # blocked in the collective, its beat thread alive
    stall = find_stall([waiting, stopped], num_hosts=2, started_at=0.0, now=171.0, rule=rule)
    assert stall is not None and stall.last_step == 10 and stall.allowed_s == 60.0
    assert stall.behind == ("host 1 (pid 101 on 10.0.0.1): at step 10, silent for 70 s",)
    assert stall.message("gb200-rack") == (
        "pool gb200-rack stalled: no step completed for 71 s after step 10 (allowed 60 s); behind: "
        "host 1 (pid 101 on 10.0.0.1): at step 10, silent for 70 s")


def test_a_host_at_an_older_step_or_never_heard_is_behind_and_a_collective_hang_names_nobody():
    rule = StallRule(timeout_s=10.0)
    hosts = [_host(0, 7, advanced=50.0, heard=99.0), _host(1, 6, advanced=40.0, heard=99.0)]
    stall = find_stall(hosts, num_hosts=3, started_at=0.0, now=100.0, rule=rule)
    assert [b.split(":")[0] for b in stall.behind] == ["host 1 (pid 101 on 10.0.0.1)", "host 2"]
    assert stall.behind[1] == "host 2: never reported"
    every_one_alive = [_host(0, 7, advanced=50.0, heard=99.0), _host(1, 7, advanced=50.0, heard=99.5)]
    hang = find_stall(every_one_alive, num_hosts=2, started_at=0.0, now=100.0, rule=rule)
    assert hang.behind == () and "every host is alive at the same step" in hang.message("p")


def test_startup_and_long_phases_get_the_startup_allowance():
    rule = StallRule(timeout_s=10.0, startup_s=300.0)
    starting = [HostProgress(0, heard_at=5.0, beats=1), HostProgress(1, heard_at=5.0, beats=1)]
    assert find_stall(starting, num_hosts=2, started_at=0.0, now=299.0, rule=rule) is None  # restore + compile
    stall = find_stall(starting, num_hosts=2, started_at=0.0, now=301.0, rule=rule)
    assert stall.allowed_s == 300.0 and stall.last_step is None
    compiling = [_host(0, 50, advanced=100.0, heard=150.0, phase="compile"), _host(1, 50, advanced=100.0, heard=150.0)]
    assert find_stall(compiling, num_hosts=2, started_at=0.0, now=399.0, rule=rule) is None  # a new seq-len phase
    assert find_stall(compiling, num_hosts=2, started_at=0.0, now=401.0, rule=rule).allowed_s == 300.0


def test_derived_timeout_uses_the_measured_step_times():
    rule = StallRule(floor_s=5.0)
    hosts = [_host(0, 3, advanced=10.0, heard=30.0)]
    assert find_stall(hosts, num_hosts=1, started_at=0.0, now=29.0, rule=rule, step_seconds=[2.0, 2.0, 2.0]) is None
    assert find_stall(hosts, num_hosts=1, started_at=0.0, now=31.0, rule=rule, step_seconds=[2.0, 2.0, 2.0]) is not None


def test_observe_uses_the_launchers_clock_and_only_changes():
    seen = observe({}, {0: {"beats": 1, "step": None, "phase": "start", "pid": 5, "node": "n"}}, now=1.0)
    assert seen[0].heard_at == 1.0 and seen[0].step is None
    seen = observe(seen, {0: {"beats": 2, "step": 1, "phase": "train", "pid": 5, "node": "n"}}, now=4.0)
    assert (seen[0].step, seen[0].advanced_at, seen[0].heard_at) == (1, 4.0, 4.0)
    seen = observe(seen, {0: {"beats": 3, "step": 1, "phase": "train", "pid": 5, "node": "n"}}, now=9.0)
    assert (seen[0].advanced_at, seen[0].heard_at) == (4.0, 9.0)  # a beat without a step: heard, not advanced
    assert observe(seen, {0: {"beats": 3, "step": 1, "phase": "train"}}, now=20.0)[0].heard_at == 9.0  # nothing new


def test_reporting_outside_a_watched_launch_is_a_no_op():
    report_step(3, 0.5)
    report_phase("eval")
    with pytest.raises(ValueError, match="unknown long phase"):
        report_phase("lunch")


# ---- the launcher with a real hang --------------------------------------------------------------------
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _steps_then_freeze(ctx, marker_dir, steps):
    """Report ``steps`` steps; on the first attempt freeze this process with SIGSTOP after step 3."""
    from marin.pools.stall import report_step

    attempt = len(os.listdir(marker_dir))
    open(os.path.join(marker_dir, f"attempt-{attempt}"), "w").close()
    for step in range(1, steps + 1):
        time.sleep(0.05)
        report_step(step, 0.05)
        if attempt == 0 and step == 3:
            os.kill(os.getpid(), signal.SIGSTOP)
    return {"attempt": attempt, "steps": steps}


@pytest.mark.slow  # two attempts, each a fresh worker importing JAX; the pure rule above is the fast check
def test_a_stopped_host_is_detected_killed_and_the_pool_relaunched(ray_local, tmp_path):
    pool = PoolSpec("tiny", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1), max_retries=1)
    markers, log = tmp_path / "markers", tmp_path / "step" / "stalls.json"
    markers.mkdir()
    rule = StallRule(timeout_s=2.0, startup_s=60.0)
    t0 = time.monotonic()
    [result] = launch(pool, _steps_then_freeze, (str(markers), 5), stall=rule, stall_log=str(log))
    assert result == {"attempt": 1, "steps": 5}
    [record] = json.loads(log.read_text())
    assert record["attempt"] == 1 and record["last_step"] == 3
    # detected once the timeout passed, at the next look at the board (every beat; generous for a loaded machine)
    assert rule.timeout_s <= record["idle_s"] < rule.timeout_s + 10.0  # (recorded to 0.1 s)
    assert record["behind"][0].startswith("host 0 (pid ") and "at step 3, silent for" in record["behind"][0]
    assert time.monotonic() - t0 < 60.0


def test_a_pool_that_stalls_on_every_attempt_is_an_infrastructure_failure(ray_local, tmp_path):
    pool = PoolSpec("tiny", hosts=1, devices_per_host=1, accelerator="cpu", mesh=(1, 1), max_retries=0)
    (tmp_path / "m").mkdir()
    with pytest.raises(PoolLostError) as err:
        launch(pool, _steps_then_freeze, (str(tmp_path / "m"), 5), stall=StallRule(timeout_s=1.0, startup_s=60.0))
    first = str(err.value).splitlines()[0]
    assert first.startswith("pool tiny failed after 1 attempt(s); last: PoolStalled: pool tiny stalled: no step "
                            "completed for ")
    assert "behind: host 0 (pid " in first
    assert is_infrastructure_failure(err.value)  # the executor retries the step from its last checkpoint
    assert issubclass(PoolStalled, RuntimeError)
