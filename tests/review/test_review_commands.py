"""The review commands as a user runs them: ``marin status | show | explain | watch | report`` and the
``executor_main`` contract (what an experiment file's post-run code can rely on)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from marin.cli import main as marin
from marin.execution import lease as leases
from marin.execution import plan_steps, resolve_config
from marin.execution import status as st
from marin.execution.status import StepStatus
from marin.execution.tasks import step_info
from marin.review.experiment_file import load_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO, "RAY_USAGE_STATS_ENABLED": "0"}


def run(args, cwd, timeout=120):
    return subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout)


def _write_experiment(folder, body: str) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "common.py"), "w") as f:
        f.write("import dataclasses\n"
                "from marin.execution import this_output_path\n"
                "from marin.execution.versioning import live\n"
                "@dataclasses.dataclass\n"
                "class Config:\n"
                "    x: int = live('a label the step does not use', default=0)\n"
                "    n: int = 3\n"
                "    out: str = dataclasses.field(default_factory=this_output_path)\n"
                "def config(x):\n    return Config(x=x)\n")
    path = os.path.join(folder, "exp.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(body))
    return path


EXP = """
    import json, sys
    from common import config                      # a sibling module, as `python exp.py` allows
    from marin.execution import ExecutorStep, executor_main

    def count(cfg):
        pass

    step = ExecutorStep("exp/count", count, config(X))
    if __name__ == "__main__":
        result = executor_main(steps=[step])
        open(result.plan.prefix + "/post-run-ran", "w").write("yes")    # post-run code, no guard
"""


def _succeed_recorded(exp_path: str, prefix: str, recorded_config_x: int | None = None) -> str:
    """Mark the file's step SUCCESS as the executor records it (optionally as run with another x)."""
    steps, _ = load_experiment(exp_path)
    if recorded_config_x is not None:
        steps[0].config.x = recorded_config_x  # live: same hash, other recorded config
    plan = plan_steps(steps, prefix)
    [ps] = plan.steps
    os.makedirs(ps.output_path)
    lease = leases.try_acquire(ps.output_path, "h", info=step_info(ps, resolve_config(ps, plan), "h"))
    st.write_status(ps.output_path, StepStatus.SUCCESS, lease=lease, consume=leases.lease_path(ps.output_path))
    return ps.output_path


def test_review_of_a_file_importing_a_sibling_module_never_runs_post_run_code(tmp_path, capsys):
    exp = _write_experiment(tmp_path / "exps", EXP.replace("X", "1"))
    prefix = str(tmp_path / "store")
    assert marin(["status", exp, "--prefix", prefix]) == 0
    assert "exp/count" in capsys.readouterr().out
    assert marin(["explain", exp, "--prefix", prefix]) == 0
    assert "1 of 1 steps would run" in capsys.readouterr().out
    assert not os.path.exists(f"{prefix}/post-run-ran")
    assert "exps" not in " ".join(sys.path)  # the folder is taken off the path again


def test_explain_lists_unversioned_changes_as_reused(tmp_path, capsys):
    exp = _write_experiment(tmp_path / "exps", EXP.replace("X", "1"))
    prefix = str(tmp_path / "store")
    _succeed_recorded(exp, prefix, recorded_config_x=2)
    assert marin(["explain", exp, "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert "0 of 1 steps would run" in out
    assert "not versioned, reused: x: 2 -> 1" in out


def test_dry_run_from_the_command_line_ends_the_file_after_the_plan(tmp_path):
    exp = _write_experiment(tmp_path / "exps", EXP.replace("X", "1"))
    r = run([sys.executable, exp, "--dry_run", "true", "--prefix", str(tmp_path / "s")], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1 of 1 steps would run" in r.stdout and not (tmp_path / "s" / "post-run-ran").exists()


def test_quickstart_dry_run_succeeds(tmp_path):
    r = run([sys.executable, "experiments/quickstart.py", "--dry_run", "true", "--prefix", str(tmp_path / "x")], REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "10 of 10 steps would run" in r.stdout and "Traceback" not in r.stderr


def test_executor_main_twice_in_one_file_is_refused(tmp_path):
    body = EXP.replace("X", "1") + "        executor_main(steps=[step])\n"
    exp = _write_experiment(tmp_path / "exps", body)
    prefix = str(tmp_path / "store")
    _succeed_recorded(exp, prefix)  # the first call has nothing to run (no Ray needed)
    r = run([sys.executable, exp, "--prefix", prefix, "--progress", "false"], tmp_path)
    assert r.returncode == 1
    assert "marin: error: executor_main called twice in one file" in r.stderr
    assert "pass every step to one call" in r.stderr and "Traceback" not in r.stderr


def test_status_and_show_on_running_interrupted_health_and_token_steps(small_experiment, capsys):
    prefix, built = small_experiment
    assert marin(["status", "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert "INTERRUPTED (holder" in out and "is gone)" in out
    assert "small/stopped: INTERRUPTED" in out and "rerun the experiment (same command) to resume it" in out
    assert marin(["show", "small/live-train", "--prefix", prefix]) == 0
    assert "step 40 (40.0% of 100 planned steps)" in capsys.readouterr().out  # from the config, not the last record
    assert marin(["show", "small/ladder-fit", "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert "health checklist (health.json)" in out and "[ALERT] grad_norm: peak 4.5 above 4" in out
    assert marin(["show", "small/tokenized", "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert "skipped documents: invalid_utf8 2, empty 1" in out and "web/q1: skipped" in out
    assert marin(["show", "small/eval", "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert "macro bpb 1.315" in out
    sets = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert sets[-3:] == [["set", "bpb", "loss", "tokens"], ["web", "1.41", "2.1", "900"],
                         ["code", "1.22", "1.8", "400"]]


def test_watch_shows_training_progress_and_stale_leases(small_experiment, capsys):
    prefix, built = small_experiment
    assert marin(["status", "--prefix", prefix, "--watch", "--count", "1"]) == 0
    out = capsys.readouterr().out
    assert "RUNNING" in out and "small/live-train" in out and "heartbeat" in out
    assert "step 40/100 (40.0%)" in out and "tok/s" in out and "eta 0m" in out
    assert "INTERRUPTED" in out and "what to do: the run stopped without finishing this step" in out


def test_status_of_a_prefix_without_steps_says_what_is_there(tmp_path, capsys):
    assert marin(["status", "--prefix", str(tmp_path / "missing")]) == 0
    assert f"{tmp_path}/missing does not exist" in capsys.readouterr().out
    assert marin(["status", "--prefix", str(tmp_path)]) == 0
    assert "exists and is empty" in capsys.readouterr().out
    (tmp_path / "notes.txt").write_text("x")
    assert marin(["status", "--prefix", str(tmp_path)]) == 0
    assert "holds 1 entries: notes.txt" in capsys.readouterr().out


def test_report_command_writes_one_file(small_experiment, tmp_path, capsys, monkeypatch):
    prefix, built = small_experiment
    monkeypatch.chdir(tmp_path)
    assert marin(["report", "--prefix", prefix]) == 0  # default -o report.html, relative to here
    assert (tmp_path / "report.html").stat().st_size > 10_000
    out = tmp_path / "r.html"
    assert marin(["report", "--prefix", prefix, "--experiment", "small", "-o", str(out)]) == 0
    assert "9 steps" in capsys.readouterr().out and out.read_text().startswith("<!DOCTYPE html>")
    assert marin(["report", "--prefix", prefix, "--experiment", "nope", "-o", str(out)]) == 2
    assert "no experiment record 'nope'" in capsys.readouterr().err
    assert marin(["report", "--prefix", str(tmp_path / "void"), "-o", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_report_into_an_existing_directory_writes_report_html_there(small_experiment, tmp_path, capsys):
    """``-o DIR`` behaves like ``cp FILE DIR``: the report is DIR/report.html (not an IsADirectoryError)."""
    prefix, _ = small_experiment
    folder = tmp_path / "reports"
    folder.mkdir()
    assert marin(["report", "--prefix", prefix, "-o", str(folder)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {folder}/report.html (9 steps")
    assert (folder / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert marin(["report", "--prefix", prefix, "-o", f"{tmp_path}/new/"]) == 0  # a path ending in / is a folder
    assert (tmp_path / "new" / "report.html").is_file()
    (tmp_path / "afile").write_text("x")
    assert marin(["report", "--prefix", prefix, "-o", str(tmp_path / "afile" / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err == (f"marin: error: cannot write the report to {tmp_path}/afile/r.html: {tmp_path}/afile is a file, "
                   "not a folder\n")
    assert (tmp_path / "afile").read_text() == "x"


def test_the_quickstart_s_review_commands_paste_as_they_print_under_a_prefix_with_a_space(tmp_path, capsys):
    """Each printed command is shell-quoted: split as a shell splits it, the prefix is one argument,
    and the command runs."""
    import importlib.util
    import shlex

    spec = importlib.util.spec_from_file_location("quickstart_copy", os.path.join(REPO, "experiments",
                                                                                  "quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # declares the steps; runs nothing (not __main__)
    prefix = str(tmp_path / "my runs" / "it's here")
    plan = plan_steps([module.mixture_report, module.health, module.evaluation], prefix)
    commands = [shlex.split(line) for line in module.review_hints(plan).splitlines() if line.startswith("  marin ")]
    assert len(commands) == 8
    assert ["marin", "show", module.train.name, "--prefix", prefix] in commands
    assert ["marin", "health", plan.planned(module.train).output_path] in commands
    status = next(c for c in commands if c[1] == "status")
    assert marin(status[1:]) == 0
    assert f"{prefix} does not exist" in capsys.readouterr().out
