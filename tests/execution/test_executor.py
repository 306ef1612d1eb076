"""The executor on a real local Ray cluster and real storage (local disk, S3 server, GCS emulator)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import fsspec
import pytest
import ray.cloudpickle

from marin.execution import (
    ExecutorError,
    ExecutorMainConfig,
    ExecutorStep,
    PreviouslyFailedError,
    StepStatus,
    executor_main,
    output_path_of,
    this_output_path,
    versioned,
)
from marin.execution import status as st
from marin.review.steps import show, status_rows

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import tests/


@dataclasses.dataclass(frozen=True)
class StepCfg:
    out: str
    log: str  # a local file every execution appends to (proves how often a body ran)
    inputs: tuple = ()
    value: int = 0
    fail_if_missing: str | None = None
    sleep: float = 0.0
    api_key: str | None = None


def body(cfg: StepCfg) -> None:
    with open(cfg.log, "a") as f:
        f.write(f"{cfg.out}\t{time.time()}\tstart\n")
    if cfg.fail_if_missing and not os.path.exists(cfg.fail_if_missing):
        raise ValueError(f"bad shard 3 (create {cfg.fail_if_missing} to fix)")
    time.sleep(cfg.sleep)
    write_total(cfg.out, cfg.value, cfg.inputs)
    with open(cfg.log, "a") as f:
        f.write(f"{cfg.out}\t{time.time()}\tend\n")


def write_total(out: str, value: int, inputs: tuple) -> None:
    """A step's output: ``value`` plus the ``total`` of each input's ``result.json``, as ``out/result.json``."""
    total = value
    for inp in inputs:
        with fsspec.open(inp) as f:
            total += json.load(f)["total"]
    with fsspec.open(f"{out}/result.json", "w") as f:
        json.dump({"total": total}, f)


def kill_worker(cfg: StepCfg) -> None:
    os._exit(3)


def check_accelerator(cfg: StepCfg) -> None:
    import ray

    assigned = ray.get_runtime_context().get_assigned_resources()
    assert assigned.get("test-accelerator") == 1, assigned
    body(cfg)


def step(name, log, *inputs, **kw):
    return ExecutorStep(
        name, kw.pop("fn", body),
        StepCfg(out=this_output_path(), log=str(log), inputs=tuple(output_path_of(i, "result.json") for i in inputs),
                value=versioned(kw.pop("value", 1)), **kw),
        resources=kw.pop("resources", None) if "resources" in kw else None,
    )


def run(steps, prefix, **flags):
    return executor_main(ExecutorMainConfig(prefix=str(prefix), progress=False, **flags), steps=steps)


def executions(log) -> list[str]:
    if not os.path.exists(log):
        return []
    return [line.split("\t")[0] for line in open(log).read().splitlines() if line.endswith("start")]


def test_diamond_runs_once_then_rerun_is_a_noop(tmp_path, ray_local):
    log = tmp_path / "log.txt"
    a = step("a", log, value=1)
    b = step("b", log, a, value=10)
    c = step("c", log, a, value=100)
    d = step("d", log, b, c, value=1000)
    result = run([d], tmp_path / "out")
    assert sorted(result.outcome.values()) == ["succeeded"] * 4
    pd = result.plan.planned(d)
    with open(f"{pd.output_path}/result.json") as f:
        assert json.load(f) == {"total": 1000 + 11 + 101}
    assert len(executions(log)) == 4
    info = st.read_info(pd.output_path)
    assert info["name"] == "d" and info["config"]["value"] == 1000 and info["holder"]
    duration, start, end = st.attempt_times(st.read_status(pd.output_path))
    assert 0 <= duration == end - start
    assert not os.path.exists(f"{pd.output_path}/.executor_lease")  # a finished step holds no lease
    assert sorted(info["dependencies"]) == sorted(s.output_path for s in pd.dependencies)
    assert info["code_fingerprint"]["fn"].endswith("body") and info["host"]
    record = json.load(open(result.record_path))
    assert {s["name"] for s in record["steps"]} == {"a", "b", "c", "d"}
    assert os.path.basename(os.path.dirname(result.record_path)).startswith(os.path.basename(sys.argv[0]).split(".")[0])

    again = run([d], tmp_path / "out")
    assert set(again.outcome.values()) == {"cached"}
    assert len(executions(log)) == 4  # nothing ran twice


def test_failure_marks_dependents_keeps_independent_branch_then_force_rerun(tmp_path, ray_local):
    log = tmp_path / "log.txt"
    fix = tmp_path / "fixed"
    a = step("a", log)
    b = step("b", log, a, fail_if_missing=str(fix))
    c = step("c", log, b)
    indep = step("independent", log, sleep=0.5)
    with pytest.raises(ExecutorError) as e:
        run([c, indep], tmp_path / "out")
    msg = str(e.value)
    assert "1 step(s) failed" in msg and "--- step b (" in msg
    assert "ValueError: bad shard 3" in msg and "Traceback" in msg and "in body" in msg  # remote traceback
    assert "not run because a dependency failed: c" in msg
    result = e.value.result
    pb, pc = result.plan.steps[1], result.plan.steps[2]
    assert st.read_status(pb.output_path)["status"] == "FAILED"
    assert "bad shard 3" in st.read_info(pb.output_path)["error"]
    assert st.read_status(pc.output_path)["status"] == "DEP_FAILED"
    assert result.outcome[result.plan.steps[3].output_path] == "succeeded"
    assert not any("/c-" in x for x in executions(log))

    with pytest.raises(PreviouslyFailedError) as e2:
        run([c, indep], tmp_path / "out")
    assert "failed in an earlier run" in str(e2.value) and "--force_run_failed" in str(e2.value)
    assert "b (" in str(e2.value)

    fix.write_text("ok")
    result = run([c, indep], tmp_path / "out", force_run_failed=True)
    assert result.outcome[pb.output_path] == "succeeded" and result.outcome[pc.output_path] == "succeeded"
    events = [e["status"] for e in st.read_status(pb.output_path)["events"]]
    assert events == ["RUNNING", "FAILED", "RUNNING", "SUCCESS"]
    assert executions(log).count(result.plan.steps[0].output_path) == 1  # a was not rerun


def test_step_that_kills_its_worker_fails_with_a_clear_message(tmp_path, ray_local):
    s = step("crasher", tmp_path / "log", fn=kill_worker)
    with pytest.raises(ExecutorError) as e:
        run([s], tmp_path / "out")
    assert "crasher" in str(e.value) and "worker process died" in str(e.value)
    path = e.value.result.plan.steps[0].output_path
    assert st.read_status(path)["status"] == StepStatus.FAILED.value


def test_declared_resources_reach_the_ray_task(tmp_path, ray_local):
    s = ExecutorStep("accel", check_accelerator, StepCfg(out=this_output_path(), log=str(tmp_path / "log")),
                     resources={"num_cpus": 1, "resources": {"test-accelerator": 1}})
    assert set(run([s], tmp_path / "out").outcome.values()) == {"succeeded"}


def test_max_concurrent_bounds_parallel_steps(tmp_path, ray_local):
    log = tmp_path / "log.txt"
    steps = [step(f"p{i}", log, value=i, sleep=0.3) for i in range(3)]
    run(steps, tmp_path / "out", max_concurrent=1)
    events = [line.split("\t") for line in open(log).read().splitlines()]
    running = peak = 0
    for _, _, kind in sorted(events, key=lambda e: float(e[1])):
        running += 1 if kind == "start" else -1
        peak = max(peak, running)
    assert peak == 1


def test_secrets_never_land_in_info_or_records(tmp_path, ray_local):
    s = step("secretive", tmp_path / "log", api_key="sk-very-secret-123")
    result = run([s], tmp_path / "out")
    path = result.plan.steps[0].output_path
    for f in (result.record_path, f"{path}/.executor_status"):
        text = open(f).read()
        assert "sk-very-secret-123" not in text
    assert st.read_info(path)["config"]["api_key"] == "***"


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_object_store_prefix_end_to_end(store, request, tmp_path, ray_local):
    prefix = request.getfixturevalue("s3_bucket" if store == "s3" else "gcs_bucket") + "/run"
    log = tmp_path / "log.txt"
    a = step("a", log, value=2)
    b = step("b", log, a, value=3)
    result = run([b], prefix)
    assert set(result.outcome.values()) == {"succeeded"}
    pb = result.plan.planned(b)
    assert pb.output_path.startswith(prefix + "/b-")
    fs = fsspec.filesystem("s3" if store == "s3" else "gs")
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(f"{pb.output_path}/result.json")) == {"total": 5}
    assert json.loads(fs.cat_file(f"{pb.output_path}/.executor_status"))["status"] == "SUCCESS"
    assert not fs.exists(f"{pb.output_path}/.executor_lease")  # removed with the commit
    assert fs.exists(result.record_path)
    rows = {r["name"]: r for r in status_rows(prefix)}  # what `marin status --prefix` lists
    assert sorted(rows) == ["a", "b"] and {r["status"] for r in rows.values()} == {"SUCCESS"}
    assert rows["b"]["hash"] == pb.hash and show(pb.output_path)["config"]["value"] == 3
    assert set(run([b], prefix).outcome.values()) == {"cached"}
    assert len(executions(log)) == 2


def run_losing_a_lease(steps, prefix, path: str, while_held=None) -> tuple[ExecutorError, list]:
    """Run ``steps`` while another executor (a thread here) presumes this one dead and takes the lease
    of the step at ``path`` over as soon as it is held; returns the run's error and what
    ``while_held()`` returned just before the takeover (what holds while that step runs)."""
    import threading

    from marin.execution import lease as leases

    seen = []

    def thief():
        deadline = time.time() + 30
        while time.time() < deadline:
            current = leases.read_lease(path)
            if current is not None and not current.released:
                if while_held is not None:
                    seen.append(while_held())
                stolen = dataclasses.replace(current, holder="thief", token=current.token + 1, host="elsewhere",
                                             expiry=time.time() + 60)
                open(f"{path}/.executor_lease", "w").write(stolen.to_json())
                return
            time.sleep(0.05)

    t = threading.Thread(target=thief)
    t.start()
    with pytest.raises(ExecutorError) as e:
        run(steps, prefix, lease_ttl=0.8)
    t.join()
    return e.value, seen


def test_holder_that_loses_its_lease_stops_and_never_writes_success(tmp_path, ray_local):
    from marin.execution import lease as leases
    from marin.execution import plan_steps

    s = step("contested", tmp_path / "log", sleep=4.0)
    prefix = tmp_path / "out"
    path = plan_steps([s], str(prefix)).steps[0].output_path
    error, _ = run_losing_a_lease([s], prefix, path)
    assert "lease lost" in str(error)
    assert error.result.outcome[path] == "lost"
    assert st.read_status(path)["status"] == "RUNNING"  # never SUCCESS, never FAILED from the loser
    assert leases.read_lease(path).holder == "thief"
    assert not os.path.exists(f"{path}/result.json")  # the body was stopped before finishing


def test_resources_no_node_offers_fail_fast_with_a_clear_message(tmp_path, ray_local):
    s = ExecutorStep("needs-gb200", body, StepCfg(out=this_output_path(), log=str(tmp_path / "log")),
                     resources={"resources": {"GB200": 4}})
    with pytest.raises(ExecutorError) as e:
        run([s], tmp_path / "out")
    assert "asks for {'GB200': 4}, which no node of the Ray cluster offers" in str(e.value)
    assert not os.path.exists(tmp_path / "log")


def test_dependent_of_a_step_that_loses_its_lease_never_runs_or_succeeds(tmp_path, ray_local):
    """Dependents are handed to Ray only after their upstream's SUCCESS; an upstream that loses its
    lease mid-run takes its dependents down with it, never submitted."""
    from marin.execution import lease as leases
    from marin.execution import plan_steps

    log = tmp_path / "log"
    up = step("up", log, sleep=4.0)
    down = step("down", log, up)
    prefix = tmp_path / "out"
    p_up, p_down = (s.output_path for s in plan_steps([down], str(prefix)).steps)
    error, down_lease = run_losing_a_lease([down], prefix, p_up, while_held=lambda: leases.read_lease(p_down))
    assert down_lease == [None]  # while up ran, down was not submitted (no lease)
    outcome = error.result.outcome
    assert outcome[p_up] == "lost" and outcome[p_down] == "dep_failed"
    assert st.read_status(p_down)["status"] == "DEP_FAILED"  # never SUCCESS
    assert p_down not in executions(log)  # its body never ran
    assert leases.read_lease(p_down).released


def test_heartbeat_racing_the_commit_never_loses_a_lease_of_its_own(tmp_path, ray_local):
    """A heartbeat every 50 ms renews leases while the loop commits and releases them: a renewal
    that collides with the driver's own commit must not be taken for a takeover."""
    log = tmp_path / "log"
    steps = [step(f"quick{i}", log, value=i) for i in range(150)]
    result = run(steps, tmp_path / "out", lease_ttl=0.2)
    assert set(result.outcome.values()) == {"succeeded"} and not result.errors
    assert len(executions(log)) == 150


def test_a_step_queued_in_ray_counts_its_time_from_when_it_ran(tmp_path, ray_local):
    """A submitted step may wait in Ray's queue (here for the accelerator another step holds); the
    time it spent queued is not its duration: `marin status` and the report count from the worker's start."""
    from marin.review import load

    log = tmp_path / "log.txt"
    one = {"num_cpus": 0, "resources": {"test-accelerator": 2}}  # the whole of the session cluster's
    first, second = (dataclasses.replace(step(name, log, value=i, sleep=1.5), resources=one)
                     for i, name in enumerate(("first", "second")))
    result = run([first, second], tmp_path / "out")
    assert sorted(result.outcome.values()) == ["succeeded"] * 2
    exp = load(prefix=str(tmp_path / "out"))
    for s in exp:
        assert 1.5 <= s.duration_s < 3.0, (s.name, s.duration_s)  # one waited ~1.5 s for the other
    records = [st.read_status(result.plan.planned(s).output_path) for s in (first, second)]
    queued = max(records, key=lambda r: r["events"][-1]["started"])
    running, success = queued["events"]
    assert running["time"] + 1.0 <= success["started"] <= success["time"]
