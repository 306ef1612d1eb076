"""What a user sees for a mistake in an experiment file or in an executor flag: one line naming the
flag, or the user's own file:line, never marin's launcher frames; and a run that would hang or pass
silently (``--max_concurrent 0``, a file that never calls ``executor_main``) is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from marin.cli import main
from marin.execution.main import parse_executor_args
from marin.execution.options import ExecutorMainConfig, FlagError, check_flags

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("argv", "line"), [
    (["--max_concurrent", "-1"], "--max_concurrent must be a whole number >= 1 (or left out: as many as Ray's "
                                 "resources allow), got -1"),
    (["--max_concurrent", "0"], "--max_concurrent must be a whole number >= 1 (or left out: as many as Ray's "
                                "resources allow), got 0"),
    (["--dry_run", "maybe"], "--dry_run: Couldn't parse 'maybe' into a bool"),
    (["--max_concurrent", "x"], "--max_concurrent: Could not decode the value into any of the given types: int: "
                                "Couldn't parse 'x' into an int"),
    (["--run_only", "("], "--run_only '(' is not a regular expression: missing ), unterminated subpattern at "
                          "position 0"),
    (["--retry_failed", "a", "[b"], "--retry_failed '[b' is not a regular expression: unterminated character set "
                                    "at position 0"),
    (["--lease_ttl", "nan"], "--lease_ttl must be a finite number of seconds > 0, got nan"),
    (["--lease_ttl", "0"], "--lease_ttl must be a finite number of seconds > 0, got 0.0"),
    (["--infra_retries", "-2"], "--infra_retries must be a whole number >= 0 (or left out: each step's own), got -2"),
])
def test_a_flag_no_run_can_use_is_one_line_naming_it(argv, line):
    with pytest.raises(FlagError) as e:
        parse_executor_args(argv)
    assert str(e.value) == line


def test_good_flags_pass_and_a_config_from_python_is_checked_the_same_way():
    flags = parse_executor_args(["--max_concurrent", "1", "--run_only", "a(b|c)", "x", "--lease_ttl", "2.5"])
    assert (flags.max_concurrent, flags.run_only, flags.lease_ttl) == (1, ["a(b|c)", "x"], 2.5)
    with pytest.raises(FlagError, match="--max_concurrent must be a whole number >= 1"):
        check_flags(ExecutorMainConfig(max_concurrent=True))  # a bool is not a count


def _marin_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marin.cli", "run", *args], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=180)


def test_max_concurrent_minus_one_is_refused_before_anything_runs(tmp_path):
    """It used to submit no step and wait at "0/2 steps" forever."""
    r = _marin_run(tmp_path, str(REPO / "experiments" / "tutorial.py"), "--prefix", str(tmp_path / "p"),
                   "--max_concurrent", "-1")
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == ["marin: error: --max_concurrent must be a whole number >= 1 (or left out: as "
                                     "many as Ray's resources allow), got -1"]
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(("source", "line"), [
    ("from marin.execution import executor_main\nsteps = (\n",
     "marin: error: '(' was never closed (at exp.py:2)"),
    ("from marin.training.config import AdamWConfig\n\noptimizer = AdamWConfig(peak_lrr=1e-3)\n",
     "marin: error: AdamWConfig.__init__() got an unexpected keyword argument 'peak_lrr' (at exp.py:3)"),
    ("x = 1\n",
     "marin: error: exp.py ran to its end without calling executor_main(steps=[...]), so no step ran; call it at the "
     "bottom of the file, under `if __name__ == \"__main__\":`"),
])
def test_a_mistake_in_the_file_is_one_line_at_its_own_line(tmp_path, monkeypatch, capsys, source, line):
    (tmp_path / "exp.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # marin run sets the file's argv and path, as python would
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(["run", "exp.py"]) == 1
    assert capsys.readouterr().err.splitlines() == [line]


def test_the_files_own_error_keeps_its_traceback_from_its_own_frame(tmp_path, monkeypatch, capsys):
    (tmp_path / "exp.py").write_text("def total(xs):\n    return sum(xs) / len(xs)\n\n\ntotal([])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    # a process where W&B ran has its exit hook in sys.excepthook: it prints the traceback, then calls
    # the hook it replaced; marin run shows the file's error once all the same
    wrapped = sys.excepthook

    def wandb_like_hook(kind, exc, tb):
        traceback.print_exception(kind, exc, tb)
        wrapped(kind, exc, tb)

    monkeypatch.setattr(sys, "excepthook", wandb_like_hook)
    assert main(["run", "exp.py"]) == 1
    err = capsys.readouterr().err.splitlines()
    # the file's two frames and its error; none of marin's launcher (marin.cli, marin run, runpy)
    assert err[0] == "Traceback (most recent call last):" and err[-1] == "ZeroDivisionError: division by zero"
    frames = [e for e in err if e.startswith("  File ")]
    assert [f.split(", in ")[-1] for f in frames] == ["<module>", "total"], err
    assert all(str(tmp_path / "exp.py") in f for f in frames), err


PLANNED_INF = """import dataclasses
from marin.execution import ExecutorStep, executor_main, this_output_path


@dataclasses.dataclass(frozen=True)
class Cfg:
    output_path: str
    threshold: float


def work(cfg):
    pass


probe = ExecutorStep("probe/a", work, Cfg(this_output_path(), float("inf")))
if __name__ == "__main__":
    executor_main(steps=[probe])
"""


def test_a_value_the_plan_cannot_version_names_the_field_once_and_the_steps_line(tmp_path):
    """A config the experiment file's own class builds (no check of its own) is refused by the plan:
    the field named once (it used to be twice), with the line that declared the step."""
    (tmp_path / "exp.py").write_text(PLANNED_INF)
    r = _marin_run(tmp_path, "exp.py", "--prefix", str(tmp_path / "p"), "--dry_run", "true")
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == [
        "marin: error: step 'probe/a': config field threshold is inf: NaN and infinity cannot be versioned (they have "
        "no stable meaning as a version); use a finite number or None (at exp.py:15)"]
    assert not (tmp_path / "p").exists()
