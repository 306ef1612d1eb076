"""The executor's error types, and one-line errors for mistakes in experiment files, wherever raised.

A bad step name or config is usually found while the experiment file is being imported (at
``ExecutorStep(...)``), before ``executor_main`` can catch anything. :func:`excepthook` prints such an uncaught error as
``marin: error: <message> (at exp.py:12)`` instead of a traceback into the executor's internals.
The entry points install it: ``marin`` (:func:`marin.cli.main`) and, for ``python exp.py``,
:mod:`marin.execution` when :func:`running_a_script` (never in a library, notebook or test run).
A ``ValueError`` that a library function raised for a declaration at the top level of the experiment
file (``default_train(...)`` with a batch its pool cannot split, a step that does not fit) is an
experiment-file mistake too, printed the same way, as ``marin explain`` prints it, and so are a call
at the file's top level whose arguments do not fit (a misspelt keyword) and a syntax error in the
file (:func:`file_mistake_line`). Every other exception keeps Python's usual report, from the file's
first frame on under ``marin run`` (:func:`without_launch_frames`); ``MARIN_TRACEBACK=1`` shows the
full traceback.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from types import TracebackType

from marin.execution.plan import PlanError
from marin.execution.step import InvalidStepError, script_path
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


def declaration_location(tb: TracebackType | None, script: str | None) -> str | None:
    """``file:line`` of the experiment file's top-level statement whose call raised, when the error
    came from a function it called (a library's check of a declaration), else None: an error the
    file's own code raised, or one raised while steps run, keeps its traceback."""
    if not script:
        return None
    frames = traceback.extract_tb(tb)
    script = os.path.abspath(script)
    top = [i for i, f in enumerate(frames) if f.name == "<module>" and os.path.abspath(f.filename) == script]
    if not top or top[-1] == len(frames) - 1:
        return None
    frame = frames[top[-1]]
    rel = os.path.relpath(frame.filename)
    return f"{frame.filename if rel.startswith('..') else rel}:{frame.lineno}"


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


BINDING_ERROR = re.compile(r"got an unexpected keyword argument|missing \d+ required|takes \d+ positional|"
                           r"got multiple values for (?:keyword )?argument")
"""Python's words for a call whose arguments do not fit the function (a misspelt keyword, a field left out)."""


def file_mistake_line(exc: BaseException, tb: TracebackType | None, script: str | None) -> str | None:
    """The one line an experiment-file mistake is shown as (``marin: error: <message> (at exp.py:12)``),
    or None for an error that keeps its traceback (the file's own code raised it, or a step failed).

    The mistakes: an executor refusal (:func:`user_error_types`), anywhere; a ``ValueError`` a library
    function raised for a top-level declaration of ``script`` (a config field's check, a batch the pool
    cannot split); a call of that top level whose arguments do not fit (a misspelt keyword: Python's
    ``TypeError``, which names it and suggests the spelling); a syntax error in a file outside marin."""
    if isinstance(exc, user_error_types()):
        where = user_location(tb)
        return f"marin: error: {exc}" + (f" (at {where})" if where else "")
    if isinstance(exc, SyntaxError) and exc.filename and os.path.isfile(exc.filename) \
            and not os.path.abspath(exc.filename).startswith(_PACKAGE_DIR + os.sep):
        return f"marin: error: {exc.msg} (at {_shown(exc.filename)}:{exc.lineno})"
    if isinstance(exc, ValueError) and (where := declaration_location(tb, script)):
        first, _, rest = str(exc).partition("\n")  # a message with a table: the place on its first line
        return f"marin: error: {first} (at {where})" + (f"\n{rest}" if rest else "")
    if type(exc) is TypeError and BINDING_ERROR.search(str(exc)) and script:
        frames = traceback.extract_tb(tb)
        last = frames[-1] if frames else None
        if last is not None and last.name == "<module>" and os.path.abspath(last.filename) == os.path.abspath(script):
            return f"marin: error: {exc} (at {_shown(last.filename)}:{last.lineno})"
    return None


def without_launch_frames(tb: TracebackType | None, script: str) -> TracebackType | None:
    """``tb`` from the experiment file's first frame on: the frames above it are marin's launcher
    (``marin run``, runpy), not the user's; None when the file never ran (it does not compile)."""
    script = os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    return tb


def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None,
               _previous=sys.excepthook) -> None:
    if not os.environ.get("MARIN_TRACEBACK"):
        line = file_mistake_line(exc, tb, sys.argv[0] if sys.argv else None)
        if line is not None:
            print(line, file=sys.stderr)
            return
    _previous(kind, exc, tb)


def show_error(exc: BaseException, tb: TracebackType | None) -> None:
    """Print ``exc`` to stderr as :func:`excepthook` would (one line for a mistake, else the traceback
    from ``tb``), without going through ``sys.excepthook``: a library the file imported may have
    wrapped that hook with one that prints the traceback itself first (W&B's exit hooks do), which
    would show the error twice."""
    excepthook(type(exc), exc, tb, traceback.print_exception)


def running_a_script() -> bool:
    """Whether this process is ``python FILE.py`` (an experiment file run as a script): ``__main__`` is
    a file, not a module run with ``-m`` (pytest, ipykernel) nor ``-c`` or an interactive session."""
    return script_path() is not None


def install_excepthook() -> None:
    """Install :func:`excepthook` once (keeping whatever hook was there for other exceptions)."""
    if getattr(sys.excepthook, "__module__", None) == __name__:
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        excepthook(kind, exc, tb, previous)

    hook.__module__ = __name__
    sys.excepthook = hook
