"""One self-contained HTML report of an experiment.

Write one HTML file (no network access needed to open it): the DAG coloured by status, a step table,
results (health, evaluation, ladder fits), and per step its config, inputs, files, plots and errors.
Give an experiment file, or a --prefix (every experiment record under it, or one with --experiment NAME).
``-o`` names the file; an existing directory (or a path ending in ``/``) gets ``report.html`` in it.
"""

from __future__ import annotations

import argparse
import os
import time

import marin.review as mr
from marin.commands import options
from marin.review.report import write_report
from marin.review.steps import describe_prefix


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", nargs="?", help="experiment file (optional with --prefix)")
    options.add_prefix(parser)
    parser.add_argument("--experiment", dest="name",
                        help="with --prefix: the experiment record to report (e.g. quickstart)")
    parser.add_argument("-o", "--output", default="report.html",
                        help="where to write the report (default: report.html; a directory: DIR/report.html)")


def run(args: argparse.Namespace) -> int:
    if args.experiment:
        exp = mr.load_file(args.experiment, args.prefix)
    else:
        exp = mr.load_prefix(args.prefix, args.name)
        if not exp.steps:
            raise FileNotFoundError(describe_prefix(args.prefix))
    t0 = time.time()
    path = write_report(exp, args.output)
    print(f"wrote {path} ({len(exp.steps)} steps, {os.path.getsize(path) / 1e6:.2f} MB, {time.time() - t0:.1f}s)"
          if os.path.exists(path) else f"wrote {path}")
    return 0
