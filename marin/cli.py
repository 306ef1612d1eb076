"""The ``marin`` command: run experiments and review what their steps produced.

    marin run EXPERIMENT.py [executor flags]     same as `python EXPERIMENT.py [flags]`
    marin status [--prefix P] [EXPERIMENT.py]    table of steps: name, hash, status, lease holder, duration
    marin show STEP [--prefix P]                 config, version tree, dependencies, outputs, error
    marin explain EXPERIMENT.py [--prefix P]     which steps would run, and why
    marin model-info PRESET [--json]             parameter and FLOP counts of a model preset
    marin eval RUN_DIR [--data NAME=PATH ...]    bits per byte of a training run's checkpoint

Every command takes --help; status, show and explain take --json for scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from typing import Any


def _fmt_duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    cells = [[h for _, h in columns]] + [[str(r.get(k) if r.get(k) is not None else "-") for k, _ in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(columns))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        from marin.execution.main import ExecutorMainConfig

        print("usage: marin run EXPERIMENT.py [--prefix P] [--dry_run true] [--force_run_failed true]\n"
              "                 [--run_only REGEX ...] [--max_concurrent N] [--address RAY_ADDRESS]\n\n"
              "Runs an experiment file exactly as `python EXPERIMENT.py [flags]` would.\n\nflags:")
        import dataclasses

        for f in dataclasses.fields(ExecutorMainConfig):
            print(f"  --{f.name}  (default: {f.default!r})")
        print("\nThe experiment's own --help (python EXPERIMENT.py --help) shows the same flags with docs.")
        return 0
    from marin.execution.review import ExperimentFileError, check_experiment_file

    try:
        path = check_experiment_file(argv[0])
    except ExperimentFileError as e:
        print(f"marin: error: {e}", file=sys.stderr)
        return 2
    sys.argv = [path, *argv[1:]]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from marin.execution.review import status_rows

    rows = status_rows(args.prefix, args.experiment)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        r["duration"] = _fmt_duration(r["duration_s"])
    if not rows:
        print("no steps found")
        return 0
    print(_table(rows, [("name", "step"), ("hash", "hash"), ("status", "status"), ("lease_holder", "lease holder"),
                        ("duration", "duration")]))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print("\n" + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from marin.execution.review import show

    d = show(args.step, args.prefix)
    if args.json:
        print(json.dumps(d, indent=1, default=repr))
        return 0
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["start_time"])) if d.get("start_time") else "-"
    print(f"step      {d['name']}-{d['hash']}\nstatus    {d['status']}  (started {when}, "
          f"duration {_fmt_duration(d['duration_s'])}, host {d.get('host')})\npath      {d['output_path']}\n"
          f"fn        {d.get('fn')}")
    if d.get("description"):
        print(f"about     {d['description']}")
    print("\nconfig:\n" + json.dumps(d.get("config"), indent=2))
    version = d.get("version") or {}
    print("\nversioned fields (what the hash is made of):")
    for path, v in (version.get("config") or {}).items():
        print(f"  {path} = {json.dumps(v)}")
    print("\ndependencies:")
    for path, dep in (version.get("dependencies") or {}).items():
        print(f"  {dep['name']}-{dep['hash']}  {path}")
    if not version.get("dependencies"):
        print("  (none)")
    print("\noutputs:\n" + ("\n".join(f"  {o}" for o in d["outputs"]) or "  (none)"))
    if d.get("health"):
        from marin.monitoring.health import format_report

        print("\ntraining health (metrics.jsonl):\n" + format_report(d["health"]))
    if d.get("error"):
        print(f"\nerror: {d['error']}\n{d.get('traceback') or ''}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from marin.execution.review import explain

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="marin", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("run", help="run an experiment file (flags as for python EXPERIMENT.py)", add_help=False)
    prefix_help = "output prefix (default: $MARIN_PREFIX, else ./local_store)"
    p = sub.add_parser("status", help="table of steps and their status",
                       description="List steps with status, lease holder and duration: those of an experiment "
                                   "file if given (including steps never run), else every step under the prefix.")
    p.add_argument("experiment", nargs="?", help="experiment file (optional)")
    p.add_argument("--prefix", help=prefix_help)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("show", help="everything about one step",
                       description="Show a step's config, versioned fields, dependencies, outputs and error. "
                                   "STEP is a step directory or a step name (latest run of that name).")
    p.add_argument("step")
    p.add_argument("--prefix", help=prefix_help)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("explain", help="which steps would run, and why",
                       description="For each step of an experiment: would it run, and why (no previous output, "
                                   "failed earlier, which versioned field or upstream step changed its hash), plus "
                                   "warnings when a step's code changed since its recorded run.")
    p.add_argument("experiment")
    p.add_argument("--prefix", help=prefix_help)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("model-info", help="parameter and FLOP counts of a model preset", add_help=False)
    sub.add_parser("eval", help="bits per byte of a training run's checkpoint on text", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 2
    if argv[0] == "run":
        return cmd_run(argv[1:])
    if argv[0] == "model-info":
        from marin.models.cli import model_info_main

        return model_info_main(argv[1:])
    if argv[0] == "eval":
        from marin.evaluation.cli import eval_main

        return eval_main(argv[1:])
    args = parser.parse_args(argv)
    try:
        return {"status": cmd_status, "show": cmd_show, "explain": cmd_explain}[args.command](args)
    except (FileNotFoundError, ValueError) as e:
        print(f"marin: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `marin show ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
