"""What a user sees for mistakes that used to end in a traceback or a wrong message: a --prefix that is a
file, a step name too long for a directory, non-positive sizes for marin plan, an added lr_replans in
explain, and the experiment record after a cached re-run or alongside a concurrent run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marin.execution import ExecutorStep, InvalidStepError
from marin.execution.executor import merged_outcomes
from marin.review.explain import unversioned_changes

REPO = Path(__file__).resolve().parents[1]


def marin(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marin.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)


@pytest.mark.parametrize("command", [["status"], ["report"], ["watch", "--count", "1"]])
def test_a_prefix_that_is_a_file_is_one_line(tmp_path, command):
    afile = tmp_path / "notes.txt"
    afile.write_text("not a store")
    r = marin(*command, "--prefix", str(afile), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"marin: error: --prefix {afile} is a file, not a directory of step outputs; pass the directory a run wrote "
        "to (the --prefix it ran with; the default is $MARIN_PREFIX, else ./local_store)")
    assert "Traceback" not in r.stderr


def test_a_step_name_too_long_for_a_directory_is_refused_at_declaration():
    with pytest.raises(InvalidStepError) as e:
        ExecutorStep("probe/" + "x" * 300, print, {})
    assert str(e.value) == (
        "step name 'xxxxxxxxxxxxxxxxxxxxxxxx...' has a part of 300 characters; a part becomes a directory name, which "
        "filesystems limit to 255 bytes (the last part to 244, leaving room for '-' and the hash): shorten it, or "
        "split it into parts with '/'")
    ExecutorStep("probe/" + "x" * 244, print, {})  # the longest that fits


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--seq-len", "-4", "argument --seq-len: must be a positive whole number, got -4"),
    ("--tokens-per-step", "0", "argument --tokens-per-step: must be a positive whole number, got 0"),
    ("--steps", "-100", "argument --steps: must be a positive whole number, got -100"),
    ("--planned-tokens", "-1e12", "argument --planned-tokens: must be a positive number, got -1e12"),
])
def test_marin_plan_refuses_non_positive_sizes(tmp_path, flag, value, message):
    r = marin("plan", "tiny", "--pool", "local-cpu-1", f"{flag}={value}", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"marin plan: error: {message}"
    assert "GiB" not in r.stdout and "fits" not in r.stdout


def test_explain_shows_an_added_lr_replan_whole():
    from marin.execution.jsonable import to_jsonable
    from marin.training.config import SyntheticDataConfig, TrainConfig

    before = TrainConfig(output_path="/x", data=SyntheticDataConfig(vocab_size=512), model="tiny")
    after = dataclasses.replace(before, lr_replans=((60, 100),))
    assert unversioned_changes(to_jsonable(before), after, []) == ["lr_replans: [] -> [[60, 100]]"]
    again = dataclasses.replace(before, lr_replans=((60, 90),))
    assert unversioned_changes(to_jsonable(after), again, []) == ["lr_replans[0][1]: 100 -> 90"]


def test_explain_words_a_field_added_removed_or_changed():
    recorded = {"lr": 1e-3, "data": {"seed": 1}}
    assert unversioned_changes(recorded, {"lr": 1e-3, "data": {"seed": 1}, "tag": "x"}, []) == ["tag added ('x')"]
    assert unversioned_changes(recorded, {"data": {"seed": 1}}, []) == ["lr removed (was 0.001)"]
    # a field whose shape changed reads whole; one whose shape stayed names the leaf
    assert unversioned_changes(recorded, {"lr": 1e-3, "data": {"seed": 1, "shuffle": True}}, []) == \
        ["data: {'seed': 1} -> {'seed': 1, 'shuffle': True}"]
    assert unversioned_changes(recorded, {"lr": 1e-3, "data": {"seed": 2}}, []) == ['data["seed"]: 1 -> 2']


def test_the_record_keeps_the_run_that_produced_an_output():
    previous = {"a": "succeeded", "b": "failed", "c": "succeeded", "d": "succeeded"}
    new = {"a": "cached", "b": "succeeded", "c": "reused", "d": "not_selected", "e": "dry_run"}
    assert merged_outcomes(previous, new) == {"a": "succeeded", "b": "succeeded", "c": "succeeded",
                                              "d": "succeeded", "e": "dry_run"}


def test_a_cached_rerun_reports_the_run_that_produced_the_outputs(tmp_path, ray_local):
    sys.path.insert(0, str(REPO / "tests" / "execution"))
    from test_executor import run, step

    import marin.review as mr

    a = step("a", tmp_path / "log", value=1)
    b = step("b", tmp_path / "log", a, value=2)
    first = run([b], tmp_path / "out")
    again = run([b], tmp_path / "out")
    assert set(again.outcome.values()) == {"cached"}
    record = json.loads(Path(again.record_path).read_text())  # the rerun's own record
    assert [s["outcome"] for s in record["steps"]] == ["succeeded", "succeeded"]
    assert os.path.dirname(first.record_path) == os.path.dirname(again.record_path)  # one experiment, two runs
    exp = mr.load_prefix(str(tmp_path / "out"))
    assert {s.state.category for s in exp.steps} == {"succeeded"}


def test_explain_names_outputs_left_without_a_record(tmp_path):
    from marin.review.explain import explain

    exp = tmp_path / "exp.py"
    exp.write_text(
        "import dataclasses\nfrom marin.execution import ExecutorStep, executor_main, this_output_path, versioned\n"
        "@dataclasses.dataclass(frozen=True)\nclass Cfg:\n    out: str\n    n: int\n"
        "def work(cfg):\n    pass\n"
        "if __name__ == '__main__':\n"
        "    executor_main(steps=[ExecutorStep('probe/train', work, Cfg(this_output_path(), versioned(1)))])\n")
    (row,) = explain(str(exp), str(tmp_path / "store"))
    assert row["reasons"] == ["no previous output at this hash"]
    step_dir = Path(row["output_path"])
    (step_dir / "checkpoints" / "step-00000005").mkdir(parents=True)
    (step_dir / "metrics.jsonl").write_text("{}\n")
    (row,) = explain(str(exp), str(tmp_path / "store"))
    assert row["reasons"] == ["no status record at this hash, but its directory holds 2 entries (checkpoints, "
                              "metrics.jsonl): the run resumes from what is there"]
