"""``executor_main``: the one call at the bottom of every experiment file."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence

import draccus

from marin.execution.errors import ExecutorError, ExecutorInterrupted
from marin.execution.executor import run_plan
from marin.execution.hashing import UnhashableConfigError
from marin.execution.jsonable import mask_text
from marin.execution.options import ExecutorMainConfig, FlagError, RunOptions, check_flags
from marin.execution.outcome import RunResult
from marin.execution.plan import PlanError, plan_steps
from marin.execution.prefix import DEFAULT_PREFIX, resolve_prefix
from marin.execution.signals import StopSignals, ignore_stop_signals, stop_reason
from marin.execution.step import ExecutorStep, InvalidStepError

__all__ = ["DEFAULT_PREFIX", "ExecutorMainConfig", "ExperimentLoaded", "executor_main", "parse_executor_args"]


def _extract_run_only(argv: list[str], flag: str = "--run_only") -> tuple[list[str], list[str] | None]:
    """Pull ``--run_only A B ...`` (or another list ``flag``, also spelt with dashes) out of argv
    (draccus wants one token per flag; regexes may hold commas or brackets, so we do not go through
    its list syntax)."""
    out, patterns, i = [], None, 0
    spellings = (flag, flag.replace("_", "-"))
    while i < len(argv):
        arg = argv[i]
        if arg in spellings or arg.startswith(tuple(f"{f}=" for f in spellings)):
            patterns = patterns or []
            if "=" in arg:
                patterns.append(arg.split("=", 1)[1])
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                patterns.append(argv[i])
                i += 1
            continue
        out.append(arg)
        i += 1
    return out, patterns


def parse_executor_args(argv: Sequence[str]) -> ExecutorMainConfig:
    """The executor flags of ``argv``, checked (:func:`marin.execution.options.check_flags`); a value
    that does not parse (``--dry_run maybe``) or cannot be used (``--max_concurrent 0``) is a
    :class:`~marin.execution.options.FlagError` in one line naming the flag."""
    rest, run_only = _extract_run_only(list(argv))
    rest, retry_failed = _extract_run_only(rest, "--retry_failed")
    try:
        config = draccus.parse(config_class=ExecutorMainConfig, args=rest)
    except draccus.utils.DecodingError as e:  # draccus's message names the field in backquotes
        raise FlagError(f"--{'.'.join(map(str, e.key_path))}: {' '.join(str(e.message).split())}") from None
    if run_only is not None:
        config.run_only = run_only
    if retry_failed is not None:
        config.retry_failed = retry_failed
    return check_flags(config)


def _script_name() -> str:
    main = sys.modules.get("__main__")
    return os.path.basename(getattr(main, "__file__", None) or sys.argv[0] or "experiment")


CARD_FIELDS = ("hypothesis", "goal", "risks", "contingency")


def experiment_card(hypothesis: str | None = None, goal: str | None = None, risks: str | None = None,
                    contingency: str | None = None) -> dict[str, str] | None:
    """The experiment card: what the experiment expects and will do if it does not happen (free
    text; not versioned: rewording a hypothesis changes no step's output). None when all are empty.
    Credential-looking text is masked here, where the card is made, so the stored record and a
    report of the experiment file (which never reaches the executor) show the same card."""
    card = {"hypothesis": hypothesis, "goal": goal, "risks": risks, "contingency": contingency}
    for k, v in card.items():
        if v is not None and not isinstance(v, str):
            raise TypeError(f"executor_main({k}=...) must be text, got {type(v).__name__}")
    card = {k: mask_text(v.strip()) for k, v in card.items() if v and v.strip()}
    return card or None


class ExperimentLoaded(BaseException):
    """Raised by ``executor_main`` while a review tool loads an experiment file (see :func:`capturing`).

    A BaseException, like SystemExit, so an experiment's own ``except Exception`` cannot swallow it:
    loading a file for review stops at its ``executor_main`` call and never runs its post-run code.
    """

    def __init__(self, steps: list[ExecutorStep], description: str | None, card: dict[str, str] | None = None) -> None:
        super().__init__("experiment loaded for review")
        self.steps = steps
        self.description = description
        self.card = card


_capturing = False
_script_calls: list[str] = []
"""Where ``executor_main`` was called from, in command-line mode, in this process (one call per file)."""
_calls = 0
"""How many times ``executor_main`` was called in this process, in any mode."""


def executor_main_calls() -> int:
    """How many times :func:`executor_main` was called in this process: ``marin run`` says so when a
    file ran to its end without calling it (no step ran, which would otherwise pass silently)."""
    return _calls


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """While active, ``executor_main`` raises :class:`ExperimentLoaded` with its steps instead of running."""
    global _capturing
    old, _capturing = _capturing, True
    try:
        yield
    finally:
        _capturing = old


def _caller() -> str:
    frame = sys._getframe(2)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def executor_main(
    config: ExecutorMainConfig | None = None,
    steps: list[ExecutorStep] | None = None,
    description: str | None = None,
    argv: Sequence[str] | None = None,
    *,
    hypothesis: str | None = None,
    goal: str | None = None,
    risks: str | None = None,
    contingency: str | None = None,
) -> RunResult:
    """Plan and run ``steps`` (and everything they depend on); returns the :class:`RunResult`.

    With ``config=None`` (an experiment file run as a script) the flags are parsed from ``argv``
    (default ``sys.argv[1:]``) and bad input ends the process with a one-paragraph error and exit
    status 1, as a command-line tool should; with an explicit ``config`` errors are raised, for use
    from Python.

    The contract an experiment file can rely on: code after ``executor_main`` runs only after the
    steps ran, so it may read their outputs without guards. In the two modes where nothing runs the
    file ends at this call: a command-line dry run prints the plan and exits with status 0, and a
    review tool (``marin status | explain | report``, :mod:`marin.review`) loading the file gets the
    steps through :class:`ExperimentLoaded`. A file declares its whole DAG in one call: a second
    command-line call in the same process is refused, since review tools and dry runs see only the
    first and a second record would split one experiment in two.

    ``hypothesis``, ``goal``, ``risks`` and ``contingency`` are the experiment card (free text, not
    versioned): written to the experiment record and shown at the top of ``marin report`` next to
    the outcome.
    """
    global _calls
    _calls += 1
    card = experiment_card(hypothesis, goal, risks, contingency)
    description = mask_text(description) if description else description  # as the card: one masking for both
    if _capturing:
        raise ExperimentLoaded(list(steps or []), description, card)
    from_cli = config is None
    if from_cli:
        here = _caller()
        if _script_calls:
            print(f"marin: error: executor_main called twice in one file ({_script_calls[0]} and {here}); "
                  "pass every step to one call: executor_main(steps=[...])", file=sys.stderr)
            raise SystemExit(1)
        _script_calls.append(here)
    try:
        config = parse_executor_args(sys.argv[1:] if argv is None else argv) if from_cli else check_flags(config)
        if not steps:
            raise PlanError("executor_main() got no steps; pass steps=[...]")
        plan = plan_steps(list(steps), resolve_prefix(config.prefix))
        opts = RunOptions.of(config, prefix=plan.prefix, description=description, card=card, script=_script_name())
        if from_cli:
            # between the run's own handlers and the exit a stop signal is noted, not fatal (it would
            # cut the message or the exit short); the run's handlers take over inside run_plan
            with StopSignals() as outer, outer.deferred("exiting"):
                try:
                    result = run_plan(plan, opts)
                except ExecutorInterrupted:
                    ignore_stop_signals()  # before this block ends: its exit would put the fatal default back
                    raise
                if outer.received is not None:
                    ignore_stop_signals()
            if outer.received is not None:
                print(f"marin: stopped by {stop_reason(outer.received)} as the run ended; every step's outcome is "
                      "recorded", file=sys.stderr)
                raise SystemExit(128 + outer.received)
        else:
            result = run_plan(plan, opts)
    except (PlanError, InvalidStepError, UnhashableConfigError, ExecutorError, FlagError) as e:
        if not from_cli:
            raise
        if isinstance(e, ExecutorInterrupted):
            ignore_stop_signals()  # it exits with this signal's status; a repeated one must not cut that short
            print(f"marin: {e}", file=sys.stderr)
            raise SystemExit(128 + e.signum) from None  # the shell's convention: 130 SIGINT, 143 SIGTERM, 129 SIGHUP
        print(f"marin: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if from_cli and config.dry_run:
        raise SystemExit(0)  # nothing ran, so the file's post-run code has nothing to read
    return result
