"""Two runs of one experiment at once each keep their update of the experiment record.

Two real processes write the record of one experiment at the same moment, again and again, each
recording the step it ran; afterwards the record says both steps succeeded, on local disk and on
the local S3 server. The record is the runs' files, and nothing else."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time

from marin.execution import storage
from marin.execution.experiment_record import experiment_record_path, read_experiment_record
from marin.execution.plan import plan_steps


@dataclasses.dataclass(frozen=True)
class Cfg:
    out: str
    n: int


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WRITER = textwrap.dedent(
    '''
    import dataclasses, os, sys, time
    from marin.execution import ExecutorStep, this_output_path, versioned
    from marin.execution.options import RunOptions
    from marin.execution.experiment_record import write_experiment_record
    from marin.execution.plan import plan_steps

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        out: str
        n: int

    def body(cfg):
        pass

    ROUNDS = 20

    def steps():
        return [ExecutorStep("a", body, Cfg(this_output_path(), versioned(1))),
                ExecutorStep("b", body, Cfg(this_output_path(), versioned(2)))]

    if __name__ == "__main__":
        prefix, mine, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
        plan = plan_steps(steps(), prefix)
        ran = next(s for s in plan.steps if s.name == mine)
        for i in range(ROUNDS):  # one experiment per round; both writers write its record at the same moment
            opts = RunOptions(prefix=plan.prefix, script=f"exp{i}.py")
            time.sleep(max(0.0, start_at + 0.05 * i - time.time()))
            print(write_experiment_record(plan, opts, {ran.output_path: "succeeded"}))
    '''
)


ROUNDS = 20


def _race(tmp_path, prefix: str) -> tuple[list[list[str]], list[dict]]:
    """Run the two writers; ``(paths each wrote, the record of each round's experiment)``."""
    script = tmp_path / "exp.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": REPO}
    start_at = time.time() + 3.0  # after both interpreters have imported marin
    procs = [subprocess.Popen([sys.executable, str(script), prefix, name, str(start_at)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.split())
    sys.path.insert(0, str(tmp_path))
    try:
        import exp  # the writers' steps, to find the records they share
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("exp", None)
    plan = plan_steps(exp.steps(), prefix)
    return outs, [read_experiment_record(experiment_record_path(plan, f"exp{i}.py")) for i in range(ROUNDS)]


def _check(outs: list[list[str]], records: list[dict]) -> None:
    # each run wrote its own file, so neither rewrote the other's
    assert [len(set(o)) for o in outs] == [ROUNDS, ROUNDS] and not set(outs[0]) & set(outs[1])
    assert [{s["name"]: s["outcome"] for s in r["steps"]} for r in records] == \
        [{"a": "succeeded", "b": "succeeded"}] * ROUNDS
    assert [r["runs"] for r in records] == [2] * ROUNDS


def test_two_runs_writing_at_once_both_keep_their_outcome_on_local_disk(tmp_path):
    outs, records = _race(tmp_path, str(tmp_path / "store"))
    _check(outs, records)
    mine = json.load(open(outs[0][0]))  # a run's own file: what that run did, for a person who opens it
    assert mine["script"] == "exp0.py" and mine["run"] == os.path.basename(outs[0][0])[:-5]


def test_two_runs_writing_at_once_both_keep_their_outcome_on_s3(tmp_path, s3_bucket):
    outs, records = _race(tmp_path, f"{s3_bucket}/store")
    _check(outs, records)
    assert all(p.startswith(f"{s3_bucket}/store/experiments/exp") for p in outs[0] + outs[1])


def test_the_record_is_the_runs_files_only(tmp_path):
    """A file at the record's own path (the one shared file earlier executors rewrote) is not read."""
    import marin.review as mr
    from marin.execution import ExecutorStep, this_output_path, versioned
    from marin.execution.experiment_record import write_experiment_record
    from marin.execution.options import RunOptions

    def body(cfg):
        pass

    prefix = str(tmp_path / "store")
    plan = plan_steps([ExecutorStep("a", body, Cfg(this_output_path(), versioned(1))),
                       ExecutorStep("b", body, Cfg(this_output_path(), versioned(2)))], prefix)
    a, b = plan.steps
    legacy = experiment_record_path(plan, "exp.py")
    old = {"script": "exp.py", "description": "written by an older executor", "updated": time.time() - 60,
           "prefix": plan.prefix, "steps": [{"name": s.name, "hash": s.hash, "output_path": s.output_path,
                                             "outcome": "succeeded" if s is a else "failed", "dependencies": []}
                                            for s in plan.steps]}
    storage.write_text(legacy, json.dumps(old))
    assert read_experiment_record(legacy) is None and mr.load_prefix(prefix).records == []
    write_experiment_record(plan, RunOptions(prefix=plan.prefix, script="exp.py", description="new"),
                            {a.output_path: "cached", b.output_path: "succeeded"})
    record = read_experiment_record(legacy)
    assert {s["name"]: s["outcome"] for s in record["steps"]} == {"a": "cached", "b": "succeeded"}
    assert record["description"] == "new" and record["runs"] == 1
    exp = mr.load_prefix(prefix, "exp")
    assert exp.name.startswith("exp-") and {s.name: s.outcome for s in exp.steps} == {"a": "cached",
                                                                                      "b": "succeeded"}
    assert len(mr.load_prefix(prefix).records) == 1  # one experiment, not one per file


def test_a_torn_run_file_does_not_hide_the_other_runs(tmp_path):
    outs, _ = _race(tmp_path, str(tmp_path / "store"))
    with open(outs[0][0], "w") as f:
        f.write('{"script": "exp0.py", "ste')
    record = read_experiment_record(os.path.dirname(outs[0][0]) + ".json")
    assert record["runs"] == 1 and record["run"] == os.path.basename(outs[1][0])[:-5]
