"""Everything about one step.

Show a step's config, versioned fields, dependencies, outputs and error. STEP is a step directory or
a step name (latest run of that name).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from marin.commands import options
from marin.monitoring.health import format_report
from marin.review import outputs as step_outputs
from marin.review.gate import cutover_lines
from marin.review.sections import fields_text
from marin.review.steps import show
from marin.textfmt import format_duration, format_timestamp


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("step", help="a step directory, or a step name (its latest run under the prefix)")
    options.add_prefix(parser)
    options.add_json(parser)


def run(args: argparse.Namespace) -> int:
    d = show(args.step, args.prefix)
    if args.json:
        print(json.dumps(d, indent=1, default=repr))
        return 0
    print(f"step      {d['name']}-{d['hash']}\n"
          f"status    {d['label']}  (started {format_timestamp(d.get('start_time'))}, "
          f"duration {format_duration(d['duration_s'])}, host {d.get('host')})\npath      {d['output_path']}\n"
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
    if d.get("placement"):
        print("\npool placement:\n" + "\n".join(f"  {line}" for line in d["placement"]))
    if d.get("advice"):
        print(f"\nwhat to do: {d['advice']}")
    if d.get("health"):
        print("\ntraining health (metrics.jsonl):\n" + format_report(d["health"]))
    lines = cutover_lines(d.get("config"))
    if lines:
        print("\ncutovers (live changes and the gates they rest on):\n" + "\n".join(f"  {x}" for x in lines))
    _print_content(d.get("content") or {})
    if d.get("error"):
        print(f"\nerror: {d['error']}\n{d.get('traceback') or ''}")
    return 0


def _print_content(content: dict[str, Any]) -> None:
    """What a step's output files say, each under its title, in the order of the table of step
    outputs (:data:`marin.review.outputs.OUTPUTS`)."""
    shown = set()
    for o in step_outputs.OUTPUTS:
        data = content.get(o.key)
        if data is None or o.key in shown:
            continue
        shown.add(o.key)
        print("\n" + (o.text(data) if o.text is not None else fields_text(o.title, o.file, data)))
