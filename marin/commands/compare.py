"""Put runs side by side: differing versioned fields, overlaid curves.

Compare training runs (or other steps that run one function; a training run beside its eval step is
refused): the versioned config fields whose values differ (shown as plain values), the
last loss / bpb / grad norm / drop fraction, and with -o an HTML page of those curves overlaid
against step, tokens and FLOPs. Paired gates (``default_gate`` steps) compare too: each candidate's
paired loss difference, speedup, fraction dropped and verdict, one row per candidate. Each argument
is a step directory or a step name (latest run of that name under the prefix).
"""

from __future__ import annotations

import argparse
import json
import sys

from marin.commands import options
from marin.execution import storage
from marin.review import Step
from marin.review.compare import check_one_kind, compare, comparison_html, format_comparison
from marin.review.steps import find_step


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("steps", nargs="+", metavar="RUN_OR_STEP", help="step directories or step names")
    options.add_prefix(p)
    options.add_json(p)
    p.add_argument("-o", "--output", default=None, help="also write the overlaid curves as one HTML file")


def run(args: argparse.Namespace) -> int:
    if len(args.steps) < 2:
        raise ValueError("compare needs at least two runs or steps (paths or step names)")
    steps = [Step(find_step(t, args.prefix)) for t in args.steps]
    check_one_kind(steps)
    result = compare(steps)
    print(json.dumps(result, default=repr) if args.json else format_comparison(result))
    if args.output:
        storage.write_text(args.output, "<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>marin compare"
                           "</title></head><body>" + comparison_html(steps) + "</body></html>")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
