"""The ``marin`` command: every subcommand is registered one way and answers ``--help``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import marin.commands
from marin.cli import COMMANDS, command_module, main


def test_every_command_module_is_registered_and_every_registered_command_has_a_module():
    modules = {m.name for m in pkgutil.iter_modules(marin.commands.__path__)} - {"options"}
    assert modules == {name.replace("-", "_") for name in COMMANDS}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_follows_the_one_pattern(name):
    module = command_module(name)
    assert module.__doc__ and module.__doc__.strip().splitlines()[0], f"{name}: no summary line"
    assert list(inspect.signature(module.add_arguments).parameters) and list(inspect.signature(module.run).parameters)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_of_every_command(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith(f"usage: marin {name}"), out
    summary = importlib.import_module(command_module(name).__name__).__doc__.strip().split("\n\n")
    assert (summary[1] if len(summary) > 1 else summary[0]).split()[0] in out


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and all(f"    {name}" in out for name in COMMANDS)
    synopsis = out.split("positional arguments")[0]  # the usage lines above the argparse listing
    assert not [name for name in COMMANDS if f"    marin {name} " not in synopsis]
    assert main([]) == 2  # no command: the help, and a usage error status


def test_an_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["sttaus"])
    assert exit_.value.code == 2 and "invalid choice: 'sttaus'" in capsys.readouterr().err


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["show", "no-such-step", "--prefix", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("marin: error: no step directory 'no-such-step'") and err.count("\n") == 1
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "marin: error: experiment file" in capsys.readouterr().err


def test_importing_marin_installs_no_process_wide_hook_but_the_entry_points_do(tmp_path):
    """A library, notebook or test that imports marin keeps its sys.excepthook; ``marin`` and an
    experiment file run as a script get the one-line report of experiment-file mistakes."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    check = "import sys, marin.execution, marin.review; print(sys.excepthook is sys.__excepthook__)"
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.strip() == "True", r.stderr
    script = tmp_path / "exp.py"
    script.write_text("import sys, marin.execution\nprint(sys.excepthook is sys.__excepthook__)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.strip() == "False", r.stderr
    r = subprocess.run([sys.executable, "-m", "marin.cli", "run", str(script)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.stdout.strip() == "False", r.stderr
