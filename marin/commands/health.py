"""Health report of a training run from its metrics.jsonl (live or finished).

    marin health <step output dir or metrics.jsonl> [--total-steps N] [--json] [--strict]

Checks, in the spirit of the published run's checklist ("first 3%: clear; next window: the real grad-norm peak
near 30%"):
  - every logged value is finite, and the run did not stop on a non-finite loss or grad norm (the
    step that diverged is never logged: the run's record says so);
  - loss is falling (recent window below the first window);
  - token drop fraction, send and receive side, below 8% in the recent window (published: healthy < 8%);
  - per phase (sequence length x transport): the transport in use and its drop fraction; a phase of
    a transport that can drop is flagged above its limit (fixed: 8%; ragged_capacity: 0.1%, the
    published run dropped 0.018% on it);
  - grad norm: where it peaked (as % of the run's planned steps), whether it is still rising, and whether it
    crossed 4 (the ladder bug that z-loss fixed);
  - MFU and throughput in the recent window.
``--strict`` exits with status 1 when a check fails, for cron jobs and CI.

With ``--fit <ladder fit step dir or fit.json>`` the run is also judged against the ladder's
prediction, window by window (first 3%, 3-10%, ...: clear / watch / act), with what the next window
should show and, on "act" within the first 25%, the lr_replans value for a shorter horizon.
``--follow SECONDS`` re-reads the growing metrics.jsonl of a live run and prints the report again
every SECONDS until interrupted (or until the run reaches its horizon).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from marin.commands import options
from marin.monitoring.health import format_report, health, prediction_report, run_outcome
from marin.training.metrics import read_metrics


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="step output directory or metrics.jsonl (local, s3://, gs://)")
    p.add_argument("--total-steps", type=options.positive_int, default=None,
                   help="planned horizon (default: the run's recorded train_steps, else the last logged step)")
    p.add_argument("--window", type=float, default=0.1, help="fraction of the run each check window covers")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--strict", action="store_true", help="exit 1 when a check fails (or a window is 'act')")
    p.add_argument("--fit", default=None, help="a ladder fit step directory or fit.json: judge against its prediction")
    p.add_argument("--plan-mfu", type=float, default=None, help="planned MFU (a fraction, e.g. 0.21)")
    p.add_argument("--plan-tokens-per-s", type=float, default=None, help="planned training tokens/s")
    p.add_argument("--follow", type=float, default=None, metavar="SECONDS",
                   help="re-read the live run's metrics every SECONDS and print again")


def run(args: argparse.Namespace) -> int:
    run_dir = args.path.removesuffix("/metrics.jsonl")
    while True:
        try:
            records = read_metrics(args.path)
            outcome = run_outcome(run_dir)  # the planned horizon, and whether the run diverged
            report = health(records, args.total_steps or outcome["planned_steps"], args.window,
                            diverged=outcome["diverged"])
            if args.fit:
                report["prediction"] = prediction_report(run_dir, args.fit, args.total_steps, args.plan_mfu,
                                                         args.plan_tokens_per_s)
        except FileNotFoundError as e:
            print(f"marin health: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(report, indent=1) if args.json else format_report(report), flush=True)
        done = report.get("prediction", {}).get("progress", report["summary"].get("progress_pct", 0) / 100) >= 1 \
            or outcome["diverged"] is not None  # a diverged run logs nothing more
        if args.follow is None or done:
            break
        time.sleep(args.follow)
    bad = not report["ok"] or report.get("prediction", {}).get("level") == "act"
    return 1 if args.strict and bad else 0
