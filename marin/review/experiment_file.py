"""Loading an experiment file for review: its steps, description and card, without running anything."""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator

from marin.execution.main import ExperimentLoaded, capturing
from marin.execution.step import ExecutorStep


class ExperimentFileError(FileNotFoundError):
    pass


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    old = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = old


def check_experiment_file(path: str) -> str:
    if not os.path.isfile(path):
        raise ExperimentFileError(
            f"experiment file {path!r} not found (working directory {os.getcwd()}); "
            "pass the path to a Python file that calls executor_main(steps=[...])"
        )
    return os.path.abspath(path)


def load_experiment(path: str) -> tuple[list[ExecutorStep], str | None]:
    """The steps (and description) an experiment file passes to ``executor_main``, without running them."""
    steps, description, _ = load_experiment_card(path)
    return steps, description


def load_experiment_card(path: str) -> tuple[list[ExecutorStep], str | None, dict[str, str] | None]:
    """The steps, description and experiment card an experiment file passes to ``executor_main``.

    The file runs as ``__main__`` with its folder first on ``sys.path``, exactly as ``python FILE`` and
    ``marin run FILE`` run it (so ``from common import ...`` of a sibling module works), and stops at
    its ``executor_main`` call, so its post-run code never runs.
    """
    path = check_experiment_file(path)
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)
    try:
        with _argv([path]), capturing():
            runpy.run_path(path, run_name="__main__")
    except ExperimentLoaded as loaded:
        return loaded.steps, loaded.description, loaded.card
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    raise ExperimentFileError(f"{path} never called executor_main(steps=[...]) under __main__")
