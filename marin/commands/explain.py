"""Which steps would run, and why.

For each step of an experiment: would it run, and why (no previous output, failed earlier, which
versioned field or upstream step changed its hash), plus warnings when a step's code changed since
its recorded run.
"""

from __future__ import annotations

import argparse
import json

from marin.commands import options
from marin.review.explain import explain


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", help="experiment file")
    options.add_prefix(parser)
    options.add_json(parser)


def run(args: argparse.Namespace) -> int:
    rows = explain(args.experiment, args.prefix)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    n = sum(r["would_run"] for r in rows)
    print(f"{n} of {len(rows)} steps would run")
    for r in rows:
        print(f"{'RUN ' if r['would_run'] else 'skip'} {r['name']}-{r['hash']}  [{r['status']}]")
        for reason in r["reasons"]:
            print(f"       - {reason}")
        for w in r["warnings"]:
            print(f"       ! warning: {w}")
    return 0
