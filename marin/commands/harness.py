"""lm-evaluation-harness tasks on a training run's model.

Runs lm_eval's own evaluation (simple_evaluate) with marin's model class (registered in lm_eval as
"marin") on a run's committed checkpoint. Tasks come from local YAML files (--include-path) that
point at local data files; --output-path writes lm_eval's usual results JSON. See docs/use.md.
"""

from __future__ import annotations

import argparse
import json

from marin.commands import options
from marin.commands.sample import add_run_arguments
from marin.inference.harness import run_harness


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    p.add_argument("--tasks", required=True, help="comma-separated task names (from --include-path or lm_eval's own)")
    p.add_argument("--include-path", default=None, help="directory of task YAML files (local data, no hub access)")
    p.add_argument("--output-path", default=None, help="directory to write lm_eval's results JSON into")
    p.add_argument("--limit", type=options.positive_int, default=None, help="at most N documents per task")
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    results = run_harness(args.run, [t for t in args.tasks.split(",") if t], step=args.step, pool=args.pool,
                          include_path=args.include_path, output_path=args.output_path, limit=args.limit)
    if args.json:
        print(json.dumps(results["results"], default=str))
        return 0
    from marin.evaluation.harness import format_results  # lm_eval is loaded by now

    print(format_results(results))
    return 0
