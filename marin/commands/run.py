"""Run an experiment file (flags as for ``python EXPERIMENT.py``).

``marin run EXPERIMENT.py [flags]`` runs the file exactly as ``python EXPERIMENT.py [flags]`` would:
as ``__main__``, with its folder first on ``sys.path``. The flags are the executor's; the file's own
``--help`` (``marin run EXPERIMENT.py --help``) shows them with their documentation. Options of
``marin run`` itself (added in :func:`add_arguments`) go before the file: everything after the file
is the file's own argv. ``marin run --pools FILE EXPERIMENT.py`` makes the pools of FILE known by name
to the file; its steps carry the specs they were built with to every process the run starts.

``marin run --pool local-2host EXPERIMENT.py`` starts the local Ray cluster with one simulated node
per host of that pool (a CPU pool's hosts, as Ray nodes on this machine), so the file's steps on a
pool of several hosts can be tried before a cluster exists; the nodes stop when the run ends. With
``--address`` (or ``$RAY_ADDRESS``) the run joins that cluster instead and ``--pool`` is not needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys

from marin.commands.options import add_pools, use_pools
from marin.execution.cluster import local_cluster_with_nodes
from marin.execution.errors import show_error, without_launch_frames
from marin.execution.main import ExecutorMainConfig, executor_main_calls
from marin.pools import get_pool, simulated_nodes, simulated_pool_note
from marin.review.experiment_file import ExperimentFileError, check_experiment_file

HANDLES_ERRORS = True
"""The experiment file's own exceptions keep their traceback (marin.cli prints others as one line)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "executor flags (defaults):\n" + "\n".join(
        f"  --{f.name} ({f.default!r})" for f in dataclasses.fields(ExecutorMainConfig))
    add_pools(parser)
    parser.add_argument("--pool", default=None,
                        help="simulate this CPU pool's hosts as nodes of the local Ray cluster (e.g. local-2host); "
                             "not with --address")
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
    try:
        nodes = _simulated_nodes(args.pool, args.flags)
    except (KeyError, ValueError) as e:
        print(f"marin: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    sys.argv = [path, *args.flags]
    sys.path.insert(0, os.path.dirname(path))
    calls = executor_main_calls()
    try:
        if not nodes:
            runpy.run_path(path, run_name="__main__")
        else:
            print(f"marin run: {simulated_pool_note(get_pool(args.pool))}", file=sys.stderr, flush=True)
            with local_cluster_with_nodes(nodes):  # the executor joins it (a cluster is up) and leaves it to us
                runpy.run_path(path, run_name="__main__")
    except Exception as e:  # the file's error, shown from its own first frame (or as one line: excepthook)
        if os.environ.get("MARIN_TRACEBACK"):
            raise
        tb = without_launch_frames(e.__traceback__, path)
        show_error(e.with_traceback(tb), tb)
        return 1
    if executor_main_calls() == calls:
        print(f"marin: error: {args.experiment} ran to its end without calling executor_main(steps=[...]), so no "
              "step ran; call it at the bottom of the file, under `if __name__ == \"__main__\":`", file=sys.stderr)
        return 1
    return 0


def _simulated_nodes(pool: str | None, flags: list[str]) -> list[dict]:
    """The nodes ``--pool`` asks to simulate ([] for none, or for a one-host pool the plain local
    cluster holds); a one-line error for ``--pool`` with a cluster address."""
    if pool is None:
        return []
    address = next((f.split("=", 1)[1] if "=" in f else (flags[i + 1] if i + 1 < len(flags) else "")
                    for i, f in enumerate(flags) if f.split("=", 1)[0] == "--address"), None)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        raise ValueError(f"--pool {pool} simulates a pool's hosts on a local cluster; with a cluster address "
                         f"({address}) the run uses that cluster's nodes: drop --pool")
    return simulated_nodes(get_pool(pool))
