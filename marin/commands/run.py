"""Run an experiment file (flags as for ``python EXPERIMENT.py``).

``marin run EXPERIMENT.py [flags]`` runs the file exactly as ``python EXPERIMENT.py [flags]`` would:
as ``__main__``, with its folder first on ``sys.path``. The flags are the executor's; the file's own
``--help`` (``marin run EXPERIMENT.py --help``) shows them with their documentation. Options of
``marin run`` itself (added in :func:`add_arguments`) go before the file: everything after the file
is the file's own argv. ``marin run --pools FILE EXPERIMENT.py`` makes the pools of FILE known by name
to the file and to every process the run starts (``MARIN_POOLS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys

from marin.commands.options import add_pools, use_pools
from marin.execution.main import ExecutorMainConfig
from marin.review.experiment_file import ExperimentFileError, check_experiment_file

HANDLES_ERRORS = True
"""The experiment file's own exceptions keep their traceback (marin.cli prints others as one line)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "executor flags (defaults):\n" + "\n".join(
        f"  --{f.name} ({f.default!r})" for f in dataclasses.fields(ExecutorMainConfig))
    add_pools(parser)
    parser.add_argument("experiment", help="the experiment file (a Python file that calls executor_main)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="executor flags, passed to the file as its argv")


def run(args: argparse.Namespace) -> int:
    try:
        path = check_experiment_file(args.experiment)
    except ExperimentFileError as e:
        print(f"marin: error: {e}", file=sys.stderr)
        return 2
    if not use_pools(args, "marin run"):
        return 2
    sys.argv = [path, *args.flags]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")
    return 0
