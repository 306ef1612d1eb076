"""Table of steps and their status.

List steps with status, lease holder and duration: those of an experiment file if given (including
steps never run), else every step under the prefix.
"""

from __future__ import annotations

import argparse
import json

from marin.commands import options
from marin.review.live import watch
from marin.review.steps import describe_prefix, placement_lines, status_rows
from marin.textfmt import format_duration, format_table

COLUMNS = (("name", "step"), ("hash", "hash"), ("label", "status"), ("lease_holder", "lease holder"),
           ("duration", "duration"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", nargs="?", help="experiment file (optional)")
    options.add_prefix(parser)
    options.add_json(parser)
    parser.add_argument("--watch", action="store_true",
                        help="refresh every --interval seconds while a pipeline runs (Ctrl-C to stop): running "
                             "steps with lease holder and heartbeat age, training progress, loss, tokens/s and ETA")
    options.add_refresh(parser)


def run(args: argparse.Namespace) -> int:
    if args.watch:
        return watch(args.prefix, args.interval, args.count)
    rows = status_rows(args.prefix, args.experiment)
    for r in rows:  # a pool step's wait and left-out nodes (one read for each running or failed step)
        if r.get("status") in ("RUNNING", "FAILED"):
            r["placement"] = placement_lines(r["output_path"], running=r["status"] == "RUNNING")
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(describe_prefix(args.prefix))
        return 0
    for r in rows:
        r["duration"] = format_duration(r["duration_s"])
    print(format_table([h for _, h in COLUMNS], [[r.get(k) for k, _ in COLUMNS] for r in rows]))
    for r in rows:
        for line in r.get("placement") or []:
            print(f"{r['name']}: {line}")
    for r in rows:
        if (r.get("category") == "interrupted" or r.get("status") == "UNREADABLE") and r.get("advice"):
            print(f"{r['name']}: {r['label']}: {r['advice']}")
    counts: dict[str, int] = {}
    for r in rows:
        key = r["label"].split(" ")[0]
        counts[key] = counts.get(key, 0) + 1
    print("\n" + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0
