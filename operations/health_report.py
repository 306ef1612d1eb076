"""Health report of a training run from its metrics.jsonl (live or finished).

    python operations/health_report.py <step output dir or metrics.jsonl> [--total-steps N] [--json] [--strict]

Checks, in the spirit of the seed's checklist ("first 3%: clear; next window: the real grad-norm peak
near 30%"):
  - every logged value is finite;
  - loss is falling (recent window below the first window);
  - token drop fraction, send and receive side, below 8% in the recent window (SPEC: healthy < 8%);
  - grad norm: where it peaked (as % of the horizon), whether it is still rising, and whether it
    crossed 4 (the ladder bug that z-loss fixed);
  - MFU and throughput in the recent window.
``--strict`` exits with status 1 when a check fails, for cron jobs and CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from marin.monitoring.health import GRAD_NORM_ALARM, HEALTHY_DROP, format_report, health  # noqa: E402,F401


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Health report of a training run from its metrics.jsonl")
    p.add_argument("path", help="step output directory or metrics.jsonl (local, s3://, gs://)")
    p.add_argument("--total-steps", type=int, default=None, help="planned horizon (default: last logged step)")
    p.add_argument("--window", type=float, default=0.1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 when a check fails")
    args = p.parse_args(argv)
    from marin.training.metrics import read_metrics

    report = health(read_metrics(args.path), args.total_steps, args.window)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 1 if args.strict and not report["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
