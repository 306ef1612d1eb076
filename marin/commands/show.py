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
from marin.review.gate import cutover_lines, format_gate
from marin.review.steps import filter_rows, show
from marin.textfmt import format_duration, format_table, format_timestamp


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
    """What a step's report files say (health checklist, mixture shares, token store counts, eval)."""
    report = content.get("health_report")
    if report:
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
        print(format_table(("domain", "share"), [(n, f"{100 * share:.2f}%") for n, share in shares], right=(1,),
                           rule=False, indent="  "))
    store = content.get("token_store")
    if store:
        t = store["totals"]
        skipped = ", ".join(f"{k} {v}" for k, v in (t.get("skipped") or {}).items()) or "none"
        print(f"\ntoken store (manifest.json): {t.get('documents', 0):,} documents, {t.get('tokens', 0):,} tokens "
              f"from {t.get('files', 0)} files; skipped documents: {skipped} ({t.get('skipped_bytes', 0):,} bytes)")
        for source, counts in store["skipped_by_source"].items():
            print(f"  {source}: skipped {json.dumps(counts)}")
    filt = content.get("corpus_filter")
    if filt:
        _print_filter(filt)
    if isinstance(content.get("gate"), dict):
        print("\n" + format_gate(content["gate"]))
    ev = content.get("eval")
    if ev:
        print(f"\nevaluation (eval.json) at step {ev.get('step')}: macro bpb {ev.get('macro_bpb')}, "
              f"micro bpb {ev.get('micro_bpb')}")
        rows = [(name, v.get("bpb"), v.get("loss"), v.get("tokens")) for name, v in (ev.get("sets") or {}).items()]
        print(format_table(("set", "bpb", "loss", "tokens"), rows, right=(1, 2, 3), rule=False, indent="  "))


def _print_filter(man: dict[str, Any]) -> None:
    """A dedup or decontamination manifest: removed documents per domain and reason, a few examples."""
    t, p = man["totals"], man.get("params") or {}
    if man.get("kind") == "dedup":
        print(f"\ndeduplication (dedup_manifest.json): {p.get('shingle_size')}-word shingles, {p.get('bands')} bands x "
              f"{p.get('rows')} rows (Jaccard >= {p.get('threshold')}), scope {p.get('scope')}; "
              f"{man.get('clusters', 0):,} clusters")
    else:
        print(f"\ndecontamination (decontamination_manifest.json): {p.get('ngram')}-grams, mode {p.get('mode')}")
        for name, s in (man.get("against") or {}).items():
            print(f"  {name}: {s.get('texts', 0):,} texts ({s.get('too_short', 0)} too short), {s.get('ngrams', 0):,} "
                  f"n-grams, matched {s.get('matched_training_documents', 0):,} training documents")
    reasons = list(t.get("removed") or {})
    rows = [(r["domain"], f"{r['documents_in']:,}", f"{r['documents_out']:,}",
             *(f"{r['removed'].get(k, 0):,}" for k in reasons), f"{100 * r['removed_share']:.2f}%",
             f"{100 * r['bytes_removed_share']:.2f}%") for r in filter_rows(man)]
    print(format_table(("domain", "docs in", "docs out", *reasons, "docs removed", "bytes removed"), rows,
                       right=tuple(range(1, 5 + len(reasons))), rule=False, indent="  "))
    for s in (man.get("sample") or [])[:5]:
        if "kept" in s:
            r, k = s["removed"], s["kept"]
            print(f"  removed {r['source']}/{r['file']}#{r['record']} ({s['reason']}, similarity {s['similarity']}) "
                  f"kept {k['source']}/{k['file']}#{k['record']}")
        else:
            print(f"  removed {s['source']}/{s['file']}#{s['record']} matching {', '.join(s['sets'])}: "
                  f"\"{s['ngram'][:80]}\"")
    if man.get("skipped_files"):
        print(f"  corrupt files skipped: {len(man['skipped_files'])}")
