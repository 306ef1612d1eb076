"""The ``marin`` command: run experiments and review what their steps produced.

    marin run EXPERIMENT.py [executor flags]     same as `python EXPERIMENT.py [flags]`
    marin status [--prefix P] [EXPERIMENT.py]    table of steps: name, hash, status, lease holder, duration
    marin show STEP [--prefix P]                 config, version tree, dependencies, outputs, error
    marin explain EXPERIMENT.py [--prefix P]     which steps would run, and why
    marin report [EXPERIMENT.py] [--prefix P] [-o report.html]   one self-contained HTML report
    marin watch [--prefix P]                     live status (same as marin status --watch)
    marin model-info PRESET [--json]             parameter and FLOP counts of a model preset
    marin plan PRESET --pool P [--json]          per-device memory of a train step, and its compute cost
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
    from marin.execution.review import format_duration

    return format_duration(s)


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    cells = [[h for _, h in columns]] + [
        [str(r.get(k) if r.get(k) is not None else "-") for k, _ in columns] for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(columns))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        from marin.execution.main import ExecutorMainConfig

        print("usage: marin run EXPERIMENT.py [--prefix P] [--dry_run true] [--force_run_failed true]\n"
              "                 [--run_only REGEX ...] [--retry_failed STEP ...] [--max_concurrent N]\n"
              "                 [--address RAY_ADDRESS] [--infra_retries N] [--repair_records true]\n\n"
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
    from marin.execution.review import describe_prefix, status_rows

    if getattr(args, "watch", False):
        from marin.review.live import watch

        return watch(args.prefix, args.interval, args.count)
    rows = status_rows(args.prefix, args.experiment)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        r["duration"] = _fmt_duration(r["duration_s"])
    if not rows:
        print(describe_prefix(args.prefix))
        return 0
    print(_table(rows, [("name", "step"), ("hash", "hash"), ("label", "status"), ("lease_holder", "lease holder"),
                        ("duration", "duration")]))
    for r in rows:
        if (r.get("category") == "interrupted" or r.get("status") == "UNREADABLE") and r.get("advice"):
            print(f"{r['name']}: {r['label']}: {r['advice']}")
    counts: dict[str, int] = {}
    for r in rows:
        key = r["label"].split(" ")[0]
        counts[key] = counts.get(key, 0) + 1
    print("\n" + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from marin.review import show

    d = show(args.step, args.prefix)
    if args.json:
        print(json.dumps(d, indent=1, default=repr))
        return 0
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["start_time"])) if d.get("start_time") else "-"
    print(f"step      {d['name']}-{d['hash']}\nstatus    {d['label']}  (started {when}, "
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
    if d.get("advice"):
        print(f"\nwhat to do: {d['advice']}")
    if d.get("health"):
        from marin.monitoring.health import format_report

        print("\ntraining health (metrics.jsonl):\n" + format_report(d["health"]))
    _print_content(d.get("content") or {})
    if d.get("error"):
        print(f"\nerror: {d['error']}\n{d.get('traceback') or ''}")
    return 0


def _print_content(content: dict[str, Any]) -> None:
    """What a step's report files say (health checklist, mixture shares, token store counts, eval)."""
    report = content.get("health_report")
    if report:
        from marin.monitoring.health import format_report

        try:
            text = format_report(report)
        except (KeyError, TypeError, ValueError):  # another writer's checklist: show its checks as written
            checks = report.get("checks") or []
            text = "\n".join(f"  [{'clear' if c.get('ok') else 'ALERT'}] {c.get('name')}: {c.get('detail', '')}"
                              for c in checks if isinstance(c, dict))
            if "ok" in report:
                text += "\noverall: " + ("clear" if report["ok"] else "needs a look")
        print("\nhealth checklist (health.json):\n" + text)
    for stage in content.get("mixture_shares") or []:
        shares = sorted((stage.get("domain_shares") or {}).items(), key=lambda kv: -kv[1])
        print(f"\neffective domain shares from step {stage['start_step']} (mixture_report.json):")
        for name, share in shares:
            print(f"  {name:<24} {100 * share:6.2f}%")
    store = content.get("token_store")
    if store:
        t = store["totals"]
        skipped = ", ".join(f"{k} {v}" for k, v in (t.get("skipped") or {}).items()) or "none"
        print(f"\ntoken store (manifest.json): {t.get('documents', 0):,} documents, {t.get('tokens', 0):,} tokens "
              f"from {t.get('files', 0)} files; skipped documents: {skipped} ({t.get('skipped_bytes', 0):,} bytes)")
        for source, counts in store["skipped_by_source"].items():
            print(f"  {source}: skipped {json.dumps(counts)}")
    ev = content.get("eval")
    if ev:
        print(f"\nevaluation (eval.json) at step {ev.get('step')}: macro bpb {ev.get('macro_bpb')}, "
              f"micro bpb {ev.get('micro_bpb')}")
        for name, v in (ev.get("sets") or {}).items():
            print(f"  {name:<24} bpb {v.get('bpb')}  loss {v.get('loss')}  tokens {v.get('tokens')}")


def cmd_report(args: argparse.Namespace) -> int:
    import marin.review as mr
    from marin.review.report import write_report

    if args.experiment:
        exp = mr.load_file(args.experiment, args.prefix)
    else:
        exp = mr.load_prefix(args.prefix, args.name)
        if not exp.steps:
            from marin.execution.review import describe_prefix

            raise FileNotFoundError(describe_prefix(args.prefix))
    t0 = time.time()
    path = write_report(exp, args.output)
    print(f"wrote {path} ({len(exp.steps)} steps, {os.path.getsize(path) / 1e6:.2f} MB, {time.time() - t0:.1f}s)"
          if os.path.exists(path) else f"wrote {path}")
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


def _cmd_watch(args: argparse.Namespace) -> int:
    from marin.review.live import watch

    return watch(args.prefix, args.interval, args.count)


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
    p.add_argument("--watch", action="store_true",
                   help="refresh every --interval seconds while a pipeline runs (Ctrl-C to stop): running steps "
                        "with lease holder and heartbeat age, training progress, loss, tokens/s and ETA")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    p.add_argument("--count", type=int, default=None, help="stop after this many refreshes (default: until Ctrl-C)")
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
    p = sub.add_parser("watch", help="live status of the steps under a prefix (marin status --watch)")
    p.add_argument("--prefix", help=prefix_help)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--count", type=int, default=None, help="stop after this many refreshes (default: until Ctrl-C)")
    p = sub.add_parser("report", help="one self-contained HTML report of an experiment",
                       description="Write one HTML file (no network access needed to open it): the DAG coloured by "
                                   "status, a step table, results (health, evaluation, ladder fits), and per step its "
                                   "config, inputs, files, plots and errors. Give an experiment file, or a --prefix "
                                   "(every experiment record under it, or one with --experiment NAME).")
    p.add_argument("experiment", nargs="?", help="experiment file (optional with --prefix)")
    p.add_argument("--prefix", help=prefix_help)
    p.add_argument("--experiment", dest="name", help="with --prefix: the experiment record to report (e.g. quickstart)")
    p.add_argument("-o", "--output", default="report.html", help="where to write the report (default: report.html)")
    sub.add_parser("model-info", help="parameter and FLOP counts of a model preset", add_help=False)
    sub.add_parser("plan", help="will a training step fit its pool, and what will the run cost", add_help=False)
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
    if argv[0] == "plan":
        from marin.training.planning import plan_main

        return plan_main(argv[1:])
    if argv[0] == "eval":
        from marin.evaluation.cli import eval_main

        return eval_main(argv[1:])
    args = parser.parse_args(argv)
    try:
        return {"status": cmd_status, "show": cmd_show, "explain": cmd_explain, "report": cmd_report,
                "watch": _cmd_watch}[args.command](args)
    except (FileNotFoundError, ValueError) as e:
        print(f"marin: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `marin show ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
