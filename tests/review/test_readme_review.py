"""Every command of the README's "Review what it produced" section, as written, on a quickstart
finished by the README's own command. Slow: it runs the quickstart (about two minutes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_review_commands() -> list[str]:
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Review what it produced", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("source ")]


def test_readme_lists_review_commands():
    cmds = readme_review_commands()
    assert any(c.startswith("marin status") for c in cmds) and any(c.startswith("marin report") for c in cmds)


@pytest.mark.slow
def test_readme_review_commands_run_on_a_finished_quickstart(tmp_path):
    work = tmp_path / "checkout"  # a working directory laid out like the repository's root
    work.mkdir()
    for name in ("experiments", "operations"):
        os.symlink(os.path.join(REPO, name), work / name)
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PYTHONPATH": REPO, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0",
           "WANDB_MODE": "offline"}
    env.pop("MARIN_PREFIX", None)
    first = subprocess.run([sys.executable, "experiments/quickstart.py", "--progress", "false"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=1200)
    assert first.returncode == 0, first.stderr[-3000:]
    for line in readme_review_commands():
        r = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{line}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr, f"{line}\n{r.stderr[-3000:]}"
        if line.startswith("marin status"):
            assert r.stdout.rstrip().endswith("10 SUCCESS")  # the quickstart's 10 steps
        if line.startswith("marin explain"):
            assert "0 of 10 steps would run" in r.stdout  # all of them: the run finished
        if line.startswith("marin report"):
            assert (work / "report.html").stat().st_size > 10_000


def test_a_quickstart_run_only_of_its_corpus_summarises_only_what_ran(tmp_path):
    """The quickstart's summary after a partial run: only the first step (the corpus, the cheapest one
    that runs on Ray) ran, so neither the training run's health nor the evaluation is read."""
    env = {**os.environ, "PYTHONPATH": REPO, "RAY_USAGE_STATS_ENABLED": "0", "WANDB_MODE": "offline"}
    r = subprocess.run([sys.executable, "-m", "marin.cli", "run", "experiments/quickstart.py", "--run_only",
                        "quickstart/k40-mini", "--prefix", str(tmp_path / "store"), "--progress", "false"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "Health of the training run" not in r.stdout and "K40 validation" not in r.stdout


def test_run_result_finished_is_success_now_or_before():
    from marin.execution import ExecutorStep, this_output_path
    from marin.execution.outcome import RunResult
    from marin.execution.plan import plan_steps

    steps = [ExecutorStep(f"s{i}", print, {"out": this_output_path(), "i": i}) for i in range(4)]
    plan = plan_steps(steps, "/tmp/unused-prefix")
    outcome = dict(zip((plan.planned(s).output_path for s in steps), ("cached", "succeeded", "not_selected",
                                                                      "failed")))
    result = RunResult(plan, outcome, None)
    assert [result.finished(s) for s in steps] == [True, True, False, False]
