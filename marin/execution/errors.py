"""The executor's error types, and one-line errors for mistakes in experiment files, wherever raised.

A bad step name or config is usually found while the experiment file is being imported (at
``ExecutorStep(...)``), before ``executor_main`` can catch anything. :func:`excepthook` prints such an uncaught error as
``marin: error: <message> (at exp.py:12)`` instead of a traceback into the executor's internals.
The entry points install it: ``marin`` (:func:`marin.cli.main`) and, for ``python exp.py``,
:mod:`marin.execution` when :func:`running_a_script` (never in a library, notebook or test run).
Every other exception keeps Python's usual report; ``MARIN_TRACEBACK=1`` shows the full traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType

from marin.execution.plan import PlanError
from marin.execution.step import InvalidStepError
from marin.execution.walker import UnhashableConfigError

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ExecutorError(RuntimeError):
    """One or more steps failed; the message names each, with its error and remote traceback."""


class ExecutorInterrupted(ExecutorError):
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) ended the run; running steps were marked INTERRUPTED
    (the signal named) and their leases released. ``signum`` is the signal: the process exits with
    128 + signum, the shell's convention."""

    signum: int = 2  # SIGINT


class UnreadableRecordError(ExecutorError):
    """Some steps' status records do not parse; the run refuses to reuse or recompute them without
    ``--repair_records`` (the message says what a repair would make of each)."""


class PreviouslyFailedError(ExecutorError):
    """Steps that FAILED in an earlier run were asked to run again without ``--force_run_failed``."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Errors that mean "the experiment file is wrong", each with a message that says how."""
    return (InvalidStepError, PlanError, UnhashableConfigError)


def user_location(tb: TracebackType | None) -> str | None:
    """``file:line`` of the innermost frame outside the marin package (the user's line), if any."""
    where = None
    for frame in traceback.extract_tb(tb):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_PACKAGE_DIR + os.sep) and not frame.filename.startswith("<") and "runpy" not in path:
            where = f"{os.path.relpath(path) if not os.path.relpath(path).startswith('..') else path}:{frame.lineno}"
    return where


def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None,
               _previous=sys.excepthook) -> None:
    if issubclass(kind, user_error_types()) and not os.environ.get("MARIN_TRACEBACK"):
        where = user_location(tb)
        print(f"marin: error: {exc}" + (f" (at {where})" if where else ""), file=sys.stderr)
        return
    _previous(kind, exc, tb)


def running_a_script() -> bool:
    """Whether this process is ``python FILE.py`` (an experiment file run as a script): ``__main__`` is
    a file, not a module run with ``-m`` (pytest, ipykernel) nor ``-c`` or an interactive session."""
    main = sys.modules.get("__main__")
    return getattr(main, "__file__", None) is not None and getattr(main, "__spec__", None) is None


def install_excepthook() -> None:
    """Install :func:`excepthook` once (keeping whatever hook was there for other exceptions)."""
    if getattr(sys.excepthook, "__module__", None) == __name__:
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        excepthook(kind, exc, tb, previous)

    hook.__module__ = __name__
    sys.excepthook = hook
