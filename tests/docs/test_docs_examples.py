"""The documentation's runnable examples run (a doc example that rots is worse than none)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _python_block(doc: str, first_line: str) -> str:
    text = (REPO / doc).read_text()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"{doc} has no python block starting with {first_line!r}")


def test_user_guide_shows_the_tutorial_as_it_is():
    """The guide walks through experiments/tutorial.py; its listing must be the file (less the docstring)."""
    block = _python_block("docs/user-guide.md", "# experiments/tutorial.py")
    source = (REPO / "experiments" / "tutorial.py").read_text()
    assert block.split("\n", 1)[1] == source[source.index("import dataclasses"):]


def test_tutorial_runs_reruns_as_noop_and_explains_a_change(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "marin.cli", "run", str(REPO / "experiments" / "tutorial.py"),
           "--prefix", str(store), "--progress", "false"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Steps: 2 succeeded" in first.stderr
    [out] = (store / "tutorial").glob("sum-*/sum.json")
    assert out.read_text() == '{"sum": %d}' % sum(range(10, 1000))
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert again.returncode == 0 and "Nothing to run: all 2 steps already succeeded" in again.stderr

    # The guide's suggested edit: a new min_value re-runs only the sum, and explain says why.
    edited = tmp_path / "tutorial.py"
    edited.write_text((REPO / "experiments" / "tutorial.py").read_text().replace("min_value=10,", "min_value=20,"))
    explain = subprocess.run([sys.executable, "-m", "marin.cli", "explain", str(edited), "--prefix", str(store)],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert explain.returncode == 0, explain.stderr[-2000:]
    lines = explain.stdout.splitlines()
    assert any(ln.startswith("skip tutorial/numbers-") for ln in lines), explain.stdout
    assert any(ln.startswith("RUN  tutorial/sum-") for ln in lines), explain.stdout
    assert "min_value" in explain.stdout and "10" in explain.stdout and "20" in explain.stdout, explain.stdout


def test_model_api_example_runs(capsys):
    """docs/model.md's public-API example, as written (the test session has 8 fake CPU devices)."""
    code = _python_block("docs/model.md", "# the model API on 8 (fake) devices")
    exec(compile(code, "docs/model.md", "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert out.startswith("loss ") and "training FLOPs per token" in out, out


def test_user_guide_review_in_python_runs(tmp_path):
    """The "From Python" example of the user guide, on a prefix holding every kind of step."""
    import importlib.util

    fixtures = sys.modules.get("review_fixtures")
    if fixtures is None:
        spec = importlib.util.spec_from_file_location(
            "review_fixtures", REPO / "tests" / "review" / "review_fixtures.py"
        )
        fixtures = sys.modules["review_fixtures"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(fixtures)
    fixtures.build_small(str(tmp_path / "local_store"))
    script = tmp_path / "review.py"
    script.write_text(_python_block("docs/user-guide.md", "# review in Python"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "small/train" in r.stdout and "step 60 of 60" in r.stdout and "peak grad norm 4.0" in r.stdout
    assert "'ok': False" in r.stdout and "'macro_bpb': 1.315" in r.stdout


def test_the_operations_runbook_names_only_real_commands_and_flags():
    """operations/README.md is what an operator follows during an incident: every `marin COMMAND` it
    names exists, and every --flag it gives that command is one the command's parser accepts."""
    import argparse

    from marin.cli import COMMANDS, command_module

    text = (REPO / "operations" / "README.md").read_text()
    uses = re.findall(r"marin ([a-z][a-z-]*)((?: [^`|\n]*)?)", text)
    assert {name for name, _ in uses} >= {"watch", "health", "checkpoints", "replan-lr", "plan", "show", "status"}
    for name, rest in uses:
        assert name in COMMANDS, f"operations/README.md names marin {name}, which is not a command"
        parser = argparse.ArgumentParser()
        command_module(name).add_arguments(parser)
        options = {s for a in parser._actions for s in a.option_strings}  # noqa: SLF001 - argparse keeps no public table
        for flag in re.findall(r"(--[a-z][a-z-]*)", rest.split("#")[0]):
            assert flag in options, f"operations/README.md gives marin {name} {flag}, which it does not take"


def test_every_flag_the_guides_give_a_marin_command_is_one_it_takes(capsys):
    """Each `marin COMMAND ... --flag` in the guides is accepted by that command (``marin run``: its own
    flags and the executor's, the only ones an experiment file takes); the optimizer the training guide
    picks with a dict in the experiment file, and with ``marin plan --optimizer`` on the command line,
    is MuonH."""
    import argparse
    import dataclasses

    from marin.cli import COMMANDS, command_module, main
    from marin.execution.options import ExecutorMainConfig
    from marin.training.config import SyntheticDataConfig, TrainConfig
    from marin.training.optimizers import MuonHConfig

    docs = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
    checked = 0
    for doc in docs:
        for name, rest in re.findall(r"marin ([a-z][a-z-]*)((?: [^`|\n]*)?)", doc.read_text()):
            if name not in COMMANDS:  # prose: "marin is ...", "marin package"
                continue
            parser = argparse.ArgumentParser()
            command_module(name).add_arguments(parser)
            options = {s for a in parser._actions for s in a.option_strings}  # noqa: SLF001 - no public table
            if name == "run":
                options |= {f"--{f.name}" for f in dataclasses.fields(ExecutorMainConfig)}
            for flag in re.findall(r"(--[a-z][a-z_.-]*)", rest.split("#")[0]):
                assert flag.rstrip(".") in options, f"{doc.name} gives marin {name} {flag}, which it does not take"
                checked += 1
    assert checked > 50
    config = TrainConfig(output_path="/x", data=SyntheticDataConfig(vocab_size=64), model="tiny", train_steps=40,
                         tokens_per_step=128, seq_len_phases=((0.0, 16),),
                         optimizer={"kind": "muonh", "adam_lr": 0.001})
    assert config.optimizer == MuonHConfig(adam_lr=0.001)
    assert main(["plan", "tiny", "--pool", "local-cpu", "--optimizer", "muonh"]) == 0
    assert "optimizer_workspace" in capsys.readouterr().out  # MuonH's Newton-Schulz temporaries
