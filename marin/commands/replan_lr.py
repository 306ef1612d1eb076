"""Re-plan the token horizon of a running training step (the published run's contingency).

    marin replan-lr <step output dir> --new-total-steps N [--at-step S]

Reads the run's config and latest committed checkpoint, and prints the ``lr_replans`` value to pass to
``default_train`` (it is not part of the step's version, so the step keeps its output path): rerunning
the experiment resumes from the checkpoint and decays linearly from the LR in force at the switch to
5% of peak at the new horizon. ``--at-step`` defaults to the latest checkpoint, which is where the
resumed run continues. The LR curve around the switch is printed so the change can be reviewed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from marin.execution import status as st
from marin.textfmt import format_table
from marin.training.run import Run
from marin.training.schedule import replan_horizon, schedule_from_config


def replan(config: dict[str, Any], at_step: int, new_total: int) -> dict[str, Any]:
    """The new ``lr_replans`` tuple and a few LR values of the old and new plans (pure; the logic is
    :func:`marin.training.schedule.replan_horizon`, shared with the health report's contingency)."""
    return replan_horizon(schedule_from_config(config), at_step, new_total, int(config.get("tokens_per_step", 0)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("step_dir", help="the training step's output directory")
    p.add_argument("--new-total-steps", type=int, required=True, help="the new horizon in steps")
    p.add_argument("--at-step", type=int, default=None, help="default: the latest committed checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    run = Run(args.step_dir)
    latest = run.latest_step
    if latest is None:
        print(f"marin replan-lr: error: no committed checkpoint under {args.step_dir}", file=sys.stderr)
        return 2
    at = latest if args.at_step is None else args.at_step
    if args.new_total_steps <= at:
        print(f"marin replan-lr: error: --new-total-steps {args.new_total_steps} is not after step {at}, where the "
              f"resumed run continues{' (the latest checkpoint)' if args.at_step is None else ''}; a new horizon "
              f"must lie after it: pass --new-total-steps greater than {at}", file=sys.stderr)
        return 2
    try:
        out = replan(run.record(latest), at, args.new_total_steps)
    except ValueError as e:  # the schedule's own rule (after warmup, in step order, ...)
        print(f"marin replan-lr: error: {e}", file=sys.stderr)
        return 2
    finished = _finished(args.step_dir)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"latest checkpoint: step {latest}; horizon {out['old_total_steps']} -> {out['new_total_steps']} steps "
          f"({out['tokens_saved_or_added']:+,} tokens)")
    print(format_table(("step", "lr before", "lr after"),
                       [(row["step"], f"{row['old_lr']:.4g}", f"{row['new_lr']:.4g}") for row in out["curve"]],
                       right=(0, 1, 2), rule=False, indent="  "))
    print(f"\nset the optimizer's lr_replans={tuple(tuple(r) for r in out['lr_replans'])} in default_train(...)")
    if finished:
        print(f"note: this step already finished ({finished}): a rerun reuses it and trains nothing more. To train "
              "on under the new plan, declare a new training step (another name) that starts from this checkpoint.")
    else:
        print("then rerun the experiment: the step resumes from its checkpoint under the new plan.")
    return 0


def _finished(step_dir: str) -> str | None:
    """How the step's record says it finished (``SUCCESS``), or None while it can still resume."""
    status = st.current_status(st.read_status(step_dir))
    return status.value if status == st.StepStatus.SUCCESS else None

