"""The ``marin`` command: run experiments, review what their steps produced, plan and check runs.

    marin run [--pools FILE] EXPERIMENT.py [executor flags]   same as `python EXPERIMENT.py [flags]`
    marin status [--prefix P] [EXPERIMENT.py]    table of steps: name, hash, status, lease holder, duration
    marin show STEP [--prefix P]                 config, version tree, dependencies, outputs, error
    marin explain EXPERIMENT.py [--prefix P]     which steps would run, and why
    marin report [EXPERIMENT.py] [--prefix P] [-o report.html]   one self-contained HTML report
    marin watch [--prefix P]                     live status (same as marin status --watch)
    marin model-info PRESET [--json]             parameter and FLOP counts of a model preset
    marin plan PRESET --pool P [--pools FILE] [--json]   per-device memory of a train step, and its compute cost
    marin eval RUN_DIR [--data NAME=PATH ...]    bits per byte of a training run's checkpoint
    marin health RUN_DIR [--fit FIT] [--follow S]   health checklist of a training run (live or finished)
    marin replan-lr RUN_DIR --new-total-steps N  the lr_replans value that shortens or extends a run
    marin sample RUN_DIR --prompt TEXT ...       continue prompts with a run's model (KV-cache decoding)
    marin export RUN_DIR -o DIR                  safetensors shards, config, tokenizer, model card
    marin harness RUN_DIR --tasks T1,T2          EleutherAI lm-evaluation-harness tasks on a run's model
    marin compare RUN_OR_STEP ... [-o FILE]      versioned fields that differ; loss/bpb/grad norm/drops overlaid
    marin checkpoints RUN_DIR [--prune]          a run's checkpoints: size, tier, pins, damage, what retention deletes

Every command takes --help; status, show and explain take --json for scripts.

How to add a command (every command is registered this one way):

1. Write ``marin/commands/<name>.py`` (``-`` in the command name becomes ``_``). Its docstring's
   first line is a short summary and the rest its ``--help`` description; it defines
   ``add_arguments(parser: argparse.ArgumentParser) -> None`` (add the command's arguments; shared
   ones such as ``--prefix`` and ``--json`` come from :mod:`marin.commands.options`) and
   ``run(args: argparse.Namespace) -> int`` (do the work by calling the library, print, return the
   exit status). Import the library at the module's top: only the chosen command's module is
   imported, so a command never slows another one down.
2. Add one line to :data:`COMMANDS` below: ``"name": "one-line help shown by marin --help"``.
3. ``tests/test_cli.py`` checks that every registered command's ``--help`` works; add the command's
   behaviour tests next to the library code it drives.

A ``FileNotFoundError`` or ``ValueError`` that reaches :func:`main` is printed as one
``marin: error: ...`` line with exit status 2 (so raise those, with a message that says what to do,
for bad input), and so is a store that cannot be read (missing or refused credentials, an endpoint
that does not answer: :func:`marin.execution.failures.store_access_error`); a module that runs
user code whose own errors must keep their traceback (``run``) sets ``HANDLES_ERRORS = True`` and is
left alone. An experiment-file mistake raised while the file
is imported is printed the same way by :func:`marin.execution.errors.excepthook`, which :func:`main` installs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

from marin.execution.errors import install_excepthook
from marin.execution.failures import STORE_ADVICE, store_access_error, unreadable_store_message
from marin.execution.jsonable import mask_log_records, mask_text
from marin.execution.plan import refuse_url_credentials
from marin.execution.prefix import resolve_prefix
from marin.execution.retry import refusal_fails_fast
from marin.execution.signals import StopSignals, ignore_stop_signals, signal_of, stop_reason

COMMANDS: dict[str, str] = {
    "run": "run an experiment file (flags as for python EXPERIMENT.py)",
    "status": "table of steps and their status",
    "show": "everything about one step",
    "explain": "which steps would run, and why",
    "report": "one self-contained HTML report of an experiment",
    "watch": "live status of the steps under a prefix (marin status --watch)",
    "model-info": "parameter and FLOP counts of a model preset",
    "plan": "will a training step fit its pool, and what will the run cost",
    "eval": "bits per byte of a training run's checkpoint on text",
    "health": "health checklist of a training run from its metrics.jsonl",
    "replan-lr": "re-plan the LR horizon of a running training step",
    "sample": "continue text prompts with a training run's model",
    "export": "a run's weights as safetensors with config, tokenizer and model card",
    "harness": "lm-evaluation-harness tasks on a training run's model",
    "compare": "put runs side by side: differing versioned fields, overlaid curves",
    "checkpoints": "a run's checkpoints: size, tier, pins, and what retention deletes next (--prune)",
}
"""Command name -> one-line help. The command's code is ``marin.commands.<name with _ for ->``."""

RIDES_OUT_REFUSALS = frozenset({"run"})
"""Commands whose process drives a run: a connection the store refuses is a frontend restarting,
ridden out under the retry limit. Every other command answers a person, and a store that refuses
its first connection is not there: one line at once (:func:`marin.execution.retry.refusal_fails_fast`)."""


def command_module(name: str) -> ModuleType:
    """The module that implements command ``name`` (imported on first use)."""
    return importlib.import_module(f"marin.commands.{name.replace('-', '_')}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``marin`` parser; ``command``'s own arguments are added (only the chosen command's module
    is imported, so ``marin status`` never imports what ``marin eval`` needs)."""
    parser = argparse.ArgumentParser(prog="marin", description=__doc__.split("\n\nHow to add")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_line in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_line)
            continue
        module = command_module(name)
        summary, _, description = (module.__doc__ or help_line).strip().partition("\n\n")
        p = sub.add_parser(name, help=help_line, description=description.strip() or summary,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    install_excepthook()  # the entry point owns process-wide hooks; importing marin never installs one
    mask_log_records()  # every log line a command prints, masked as its errors are
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(command)
    if not argv:
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    module = command_module(args.command)
    if args.command in RIDES_OUT_REFUSALS:  # an experiment's run has its own stop path (marin.execution.main)
        return _run(module, args)
    with refusal_fails_fast(), StopSignals() as signals:
        try:
            return _run(module, args)
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP: what was started has been stopped on the way out
            signum = signal_of(e, signals)
            ignore_stop_signals()  # a repeated signal must not cut the message or the exit short
            print(f"marin {args.command}: stopped ({stop_reason(signum)})", file=sys.stderr)
            return 128 + signum


LOCATION_ARGUMENTS = {
    "run": "RUN", "path": "PATH", "step": "STEP", "steps": "RUN_OR_STEP", "step_dir": "STEP_DIR",
    "experiment": "EXPERIMENT", "prefix": "--prefix", "output": "-o", "output_path": "--output-path",
    "include_path": "--include-path", "fit": "--fit", "data": "--data", "task": "--task",
}
"""The arguments (by ``argparse`` dest) that name a place on a disk or a store, as the user spells them."""


def refuse_location_credentials(args: argparse.Namespace) -> None:
    """Refuse a store location given with credentials in its URL (``s3://KEY:SECRET@bucket/run``) in
    any argument of :data:`LOCATION_ARGUMENTS`, as ``--prefix`` is refused: one line that shows the
    URL masked and says where credentials go, before the store's client sees the URL (it would
    quote it in its errors, or refuse it in a traceback of its own). Raises
    :class:`marin.execution.plan.PlanError`."""
    for dest, spelled in LOCATION_ARGUMENTS.items():
        value = getattr(args, dest, None)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                refuse_url_credentials(spelled, v)


def _run(module: ModuleType, args: argparse.Namespace) -> int:
    """The command's ``run``, its errors printed in one line unless it handles them itself."""
    try:
        refuse_location_credentials(args)  # before any store client sees the URL
    except ValueError as e:
        print(f"marin: error: {e}", file=sys.stderr)
        return 2
    if getattr(module, "HANDLES_ERRORS", False):
        return module.run(args)
    try:
        return module.run(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"marin: error: {mask_text(str(e))}", file=sys.stderr)  # it may quote a path or URL given
        return 2
    except BrokenPipeError:  # `marin show ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        if store_access_error(e) is None or os.environ.get("MARIN_TRACEBACK"):
            raise
        where = (f"step outputs under {resolve_prefix(args.prefix)}" if hasattr(args, "prefix")
                 else "the store")
        print(f"marin: error: {mask_text(unreadable_store_message(where, e))}; {STORE_ADVICE}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
