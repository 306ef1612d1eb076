"""A step's dependents start only after its final SUCCESS, whatever retried it.

Plain Python step functions on the session's local Ray cluster: an upstream that fails once with an
infrastructure failure is retried by the executor; its dependents must neither run on its first,
half-finished output nor be retried on their own, and no step's start or SUCCESS may come before the
SUCCESS of any of its inputs (:func:`check_inputs_succeeded_first`, run on every step of the record)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import pytest
import ray.cloudpickle
from test_executor import write_total

from marin.execution import ExecutorError, ExecutorStep, output_path_of, this_output_path, versioned
from marin.execution import status as st
from marin.execution.failures import InfrastructureFailure
from marin.execution.main import ExecutorMainConfig, executor_main

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import tests/


@dataclasses.dataclass(frozen=True)
class Cfg:
    out: str
    log: str
    inputs: tuple = ()
    value: int = 0
    fail_first: bool = False
    sleep: float = 0.0


def work(cfg: Cfg) -> None:
    """Writes ``partial`` first, then fails with an infrastructure failure on its first execution
    when ``fail_first`` (as a training step killed mid-run leaves a checkpoint behind); otherwise
    sums its inputs' totals into ``result.json``."""
    with open(cfg.log, "a") as f:
        f.write(f"{cfg.out}\t{time.time()}\tstart\n")
    first = not os.path.exists(f"{cfg.out}/partial.json")
    with fsspec.open(f"{cfg.out}/partial.json", "w") as f:
        json.dump({"total": -1}, f)
    time.sleep(cfg.sleep)
    if cfg.fail_first and first:
        raise InfrastructureFailure("host lost mid-run")
    write_total(cfg.out, cfg.value, cfg.inputs)


def step(name, log, *inputs, **kw) -> ExecutorStep:
    return ExecutorStep(name, work, Cfg(this_output_path(), str(log),
                                        tuple(output_path_of(i, "result.json") for i in inputs),
                                        value=versioned(kw.pop("value", 1)), **kw))


def run(steps, prefix, **flags):
    return executor_main(ExecutorMainConfig(prefix=str(prefix), progress=False, **flags), steps=steps)


def success_time(record: dict) -> float:
    return next(e["time"] for e in reversed(record["events"]) if e["status"] == "SUCCESS")


def check_inputs_succeeded_first(record_path: str) -> int:
    """For every step of an experiment record: its body began (the SUCCESS event's ``started``) and
    its SUCCESS was written after the SUCCESS of each of its inputs. Returns how many steps it checked."""
    record = json.loads(Path(record_path).read_text())
    statuses = {s["output_path"]: st.read_status(s["output_path"]) for s in record["steps"]}
    checked = 0
    for s in record["steps"]:
        mine = statuses[s["output_path"]]
        assert mine and mine["status"] == "SUCCESS", (s["name"], mine and mine["status"])
        done = success_time(mine)
        began = mine["events"][-1].get("started", done)
        for dep in s["dependencies"]:
            theirs = success_time(statuses[dep])
            assert theirs <= began <= done, f"{s['name']} began at {began}, its input {dep} succeeded at {theirs}"
        checked += 1
    return checked


def test_dependents_of_a_retried_step_wait_for_its_final_success(tmp_path, ray_local):
    log = tmp_path / "log"
    up = dataclasses.replace(step("up", log, value=10, fail_first=True, sleep=0.5), infra_retries=1)
    # the dependents may retry infrastructure failures too (an eval step on a GPU pool does)
    down = dataclasses.replace(step("down", log, up, value=1), infra_retries=2)
    last = step("last", log, down, value=100)
    result = run([last], tmp_path / "out")
    assert sorted(result.outcome.values()) == ["succeeded"] * 3
    p_up, p_down, p_last = (result.plan.planned(s).output_path for s in (up, down, last))
    assert json.loads(Path(p_last, "result.json").read_text()) == {"total": 111}  # from up's final output
    assert [line.split("\t")[0] for line in log.read_text().splitlines()] == [p_up, p_up, p_down, p_last]
    down_events = st.read_status(p_down)["events"]
    assert [e["status"] for e in down_events] == ["RUNNING", "SUCCESS"]  # never retried on its own
    assert check_inputs_succeeded_first(result.record_path) == 3


@dataclasses.dataclass(frozen=True)
class RerunCfg:
    watch: str  # the input's status file: once it reads SUCCESS, make it read RUNNING again


def rerun_elsewhere(cfg: RerunCfg) -> None:
    """Holds the accelerator the dependent needs until the input has succeeded, then rewrites the
    input's record to RUNNING, as a second driver rerunning it would have it."""
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            record = json.loads(Path(cfg.watch).read_text())
        except (OSError, ValueError):
            record = None
        if record and record["status"] == "SUCCESS":
            Path(cfg.watch).write_text(json.dumps({**record, "status": "RUNNING"}))
            return
        time.sleep(0.05)
    raise TimeoutError(cfg.watch)


def test_a_step_refuses_an_input_that_is_not_success_when_it_starts(tmp_path, ray_local):
    """The driver submits ``down`` after ``up``'s SUCCESS; while ``down`` waits in Ray's queue for the
    accelerator, ``up``'s record turns RUNNING again. ``down``'s task refuses to read it: one line,
    recorded DEP_FAILED (the next run starts it again by itself), and its body never runs."""
    from marin.execution import plan_steps

    log = tmp_path / "log"
    prefix = tmp_path / "out"
    up = step("up", log, value=10)
    p_up = plan_steps([up], str(prefix)).steps[0].output_path
    down = ExecutorStep("down", work, Cfg(this_output_path(), str(log), (output_path_of(up, "result.json"),)),
                        resources={"num_cpus": 0, "resources": {"test-accelerator": 2}})
    other = ExecutorStep("other", rerun_elsewhere, RerunCfg(f"{p_up}/.executor_status"),
                         resources={"num_cpus": 0, "resources": {"test-accelerator": 2}})
    p_down = plan_steps([down], str(prefix)).steps[-1].output_path
    with pytest.raises(ExecutorError) as e:
        run([down, other], prefix)
    why = f"input up ({p_up}) is RUNNING, not SUCCESS, when this step started: not reading it"
    assert f"--- step down ({p_down}) ---\nnot run: {why}" in str(e.value)
    record = st.read_status(p_down)
    assert record["status"] == "DEP_FAILED" and record["events"][-1]["message"] == why
    assert p_down not in log.read_text()  # down's body never ran


PIPELINE = textwrap.dedent(
    '''
    import dataclasses, json
    import fsspec
    from experiments.defaults import default_health_report, default_train
    from marin.execution import ExecutorStep, executor_main, output_path_of, this_output_path
    from marin.training.config import AdamWConfig, CheckpointPolicy, SyntheticDataConfig, TelemetryConfig

    @dataclasses.dataclass(frozen=True)
    class ReadSummary:
        run: str
        out: str

    def read_summary(cfg):
        """A dependent that reads what training left (as an evaluation of its final checkpoint does)."""
        with fsspec.open(cfg.run + "/train_summary.json") as f:
            final = json.load(f)["final_step"]
        with fsspec.open(cfg.out + "/seen.json", "w") as f:
            json.dump({"final_step": final}, f)

    train = default_train("probe/train", mixture=SyntheticDataConfig(vocab_size=512), model="tiny",
                          pool="local-cpu-1", train_steps=120, tokens_per_step=128,
                          seq_len_phases=((0.0, 16),), optimizer=AdamWConfig(warmup_steps=1),
                          checkpoint=CheckpointPolicy(every_steps=20, every_minutes=None),
                          telemetry=TelemetryConfig(wandb_project=None))
    health = default_health_report("probe/health", train, total_steps=120)
    seen = ExecutorStep("probe/seen", read_summary, ReadSummary(output_path_of(train), this_output_path()),
                        resources={"num_cpus": 1})
    if __name__ == "__main__":
        executor_main(steps=[health, seen])
    '''
)


@pytest.mark.slow  # about 90 s: two launches of a training host, then its two dependents
def test_kill_9_of_the_training_host_leaves_its_dependents_on_the_final_step(tmp_path):
    """The issue as a user meets it: ``--infra_retries 1`` and a kill -9 of the ``ray::_Host`` training
    process mid-run. Health and the summary reader run once, after training's final SUCCESS, and
    record step 120; no step's start or SUCCESS predates an input's SUCCESS."""
    sys.path.insert(0, os.path.dirname(__file__))
    from test_infra_retry import run_killing_the_training_host

    returncode, err, store = run_killing_the_training_host(PIPELINE, tmp_path, infra_retries=1, kill_at_step=20,
                                                           start_s=300, finish_s=500)
    assert returncode == 0, err
    assert "RETRY probe/train: infrastructure failure" in err
    assert "RETRY probe/health" not in err and "RETRY probe/seen" not in err
    (health_dir,) = store.glob("probe/health-*")
    (seen_dir,) = store.glob("probe/seen-*")
    assert json.loads((health_dir / "health.json").read_text())["summary"]["last_step"] == 120
    assert json.loads((seen_dir / "seen.json").read_text()) == {"final_step": 120}
    for d in (health_dir, seen_dir):
        assert [e["status"] for e in st.read_status(str(d))["events"]] == ["RUNNING", "SUCCESS"]
    (record,) = store.glob("experiments/exp-*/*.json")
    assert check_inputs_succeeded_first(str(record)) == 3
