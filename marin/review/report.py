"""``marin report``: one self-contained HTML file per experiment (inline CSS, script and SVG; no
network request when opened), to look at a pipeline rather than read it, and to share it as a file.

Sections: header (experiment, description, prefix, when, run records, code fingerprint), the DAG
coloured by status, the step table, results (health checklists, evaluation tables, ladder fits), and
one section per step (config with versioned fields marked, inputs and dependents, files, content of
the step's report files, training plots, error and traceback).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import time
from typing import Any

from marin.evaluation.suite import TASK_KEY
from marin.execution import storage
from marin.execution.jsonable import mask_text
from marin.execution.main import CARD_FIELDS
from marin.execution.versioning import input_field, live
from marin.review import CATEGORIES, Experiment, Step, dependency_order
from marin.review import dag as dagmod
from marin.review import outputs as step_outputs
from marin.review.compare import comparison_html
from marin.review.explain import config_leaves, is_versioned
from marin.review.plots import line_plot
from marin.review.sections import esc as _e
from marin.review.sections import num as _num
from marin.review.sections import pct as _pct
from marin.textfmt import format_duration as _dur
from marin.textfmt import format_timestamp as _when
from marin.training.metrics import phase_summary

TASK_PREFIX = TASK_KEY.partition("{name}")[0]  # "eval/task/": the in-training eval's task results

MAX_INLINE_IMAGE = 1_500_000
"""Bytes: larger PNG outputs are listed, not embedded, so the report stays a file one can attach."""

TRAIN_PLOTS: list[tuple[str, list[str]]] = [
    ("loss", ["loss", "ce_loss"]),
    ("grad norm", ["grad_norm"]),
    ("learning rate", ["lr"]),
    ("token drop fraction", ["drop_frac_send", "drop_frac_recv"]),
    ("expert load (max / mean of per-layer max, relative to uniform)", ["expert_load_max", "expert_load_mean"]),
    ("tokens/s", ["tokens_per_s"]),
    ("MFU", ["mfu"]),
]

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d1d1f;background:#fff}
main{max-width:1200px;margin:0 auto;padding:16px 24px 80px}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:16px 0 6px}
table{border-collapse:collapse;margin:6px 0;font-size:13px}td,th{border:1px solid #e2e2e2;padding:2px 7px;
text-align:left;vertical-align:top}th{background:#f6f6f6}
td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f7f7f7;padding:8px;overflow:auto;max-height:420px;font-size:12px}
code,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
.badge{display:inline-block;padding:0 6px;border-radius:8px;font-size:12px;color:#fff}
.b-succeeded{background:#2e9e44}.b-reused{background:#5fae6c}.b-failed{background:#d83b3b}
.b-running{background:#2f7fd8}.b-interrupted{background:#e59a1c}.b-not-run{background:#999}
.legend span{margin-right:10px}
#dagwrap{overflow:auto;border:1px solid #ddd;max-height:720px}
#dag .edge{fill:none;stroke:#9a9a9a;stroke-width:1}#dag .nl{font:11px system-ui,sans-serif;fill:#111}
#dag a.node:hover rect{stroke:#000;stroke-width:2}
section.step{border-left:4px solid #ddd;padding:2px 12px;margin:18px 0}
section.step:target,section.step.hl{border-left-color:#2f7fd8;background:#f3f8ff}
tr.v td:first-child::after{content:" \\2713";color:#2e9e44}
.kv td:first-child{color:#555}
.card{display:flex;gap:2em;flex-wrap:wrap}.card>div{flex:1;min-width:320px}
.plot{margin:4px 8px 4px 0;border:1px solid #eee}.plot .pt{font:12px system-ui,sans-serif;font-weight:600}
.plot .pf{fill:none;stroke:#ccc}.plot .yl{font:10px sans-serif;text-anchor:end;fill:#555}
.plot .xl{font:10px sans-serif;text-anchor:middle;fill:#555}.plot .mk{stroke:#e59a1c;stroke-dasharray:3 3}
.plot .ml{font:10px sans-serif;fill:#b36b00}.plot .lg{font:11px sans-serif;text-anchor:end}
.ok{color:#2e9e44;font-weight:600}.alert{color:#d83b3b;font-weight:600}
.muted{color:#777}
"""

SCRIPT = """
(function(){
  function show(id){
    var el=document.getElementById(id); if(!el) return;
    document.querySelectorAll('section.hl').forEach(function(s){s.classList.remove('hl');});
    el.classList.add('hl');
    el.querySelectorAll('details').forEach(function(d){d.open=true;});
    el.scrollIntoView({block:'start'});
  }
  window.addEventListener('hashchange',function(){show(location.hash.slice(1));});
  if(location.hash) show(location.hash.slice(1));
})();
"""


def _anchor(step: Step) -> str:
    raw = f"{step.name}-{step.hash}"
    return "step-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in raw)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _badge(category: str, label: str | None = None) -> str:
    return f'<span class="badge b-{category.replace(" ", "-")}">{_e(label or category)}</span>'


# --------------------------------------------------------------------------------------------- #
# sections                                                                                         #
# --------------------------------------------------------------------------------------------- #


def _header(exp: Experiment) -> str:
    fps = sorted(json.dumps(s.info.get("code_fingerprint"), sort_keys=True) for s in exp.steps if s.info)
    fingerprint = hashlib.sha256("\n".join(fps).encode()).hexdigest()[:12] if fps else "-"
    ended = [s.end_time for s in exp.steps if s.end_time]
    when = exp.updated or (max(ended) if ended else None)
    rows = [("experiment", exp.name), ("description", mask_text(exp.description or "-")), ("prefix", exp.prefix),
            ("when it ran", _when(when)), ("code fingerprint", fingerprint + "  (digest of every step's code)"),
            ("generated", _when(time.time()))]
    if exp.source:
        rows.insert(1, ("file", exp.source))
    for rec in exp.records[-3:]:
        rows.append(("run record", f"{rec.get('script')} on {rec.get('host')} at {_when(rec.get('updated'))}: "
                                   + " ".join(rec.get("argv") or [])))
    counts: dict[str, int] = {}
    for s in exp.steps:
        counts[s.state.category] = counts.get(s.state.category, 0) + 1
    rows.append(("steps", f"{len(exp.steps)}: " + ", ".join(f"{k} {counts[k]}" for k in CATEGORIES if k in counts)))
    body = "".join(f"<tr><td>{_e(k)}<td>{_e(v)}" for k, v in rows)
    return f'<h1>{_e(exp.name)}</h1><table class="kv">{body}</table>'


def outcome_rows(exp: Experiment) -> list[tuple[str, str]]:
    """What happened, to set against the card: step counts, health verdicts, a ladder's validation
    rung (predicted against actual), evaluation and harness results."""
    rows = []
    counts: dict[str, int] = {}
    for s in exp.steps:
        counts[s.state.category] = counts.get(s.state.category, 0) + 1
    rows.append(("steps", ", ".join(f"{k} {counts[k]}" for k in CATEGORIES if k in counts) or "none"))
    for s in exp.steps:
        if s.state.category not in ("succeeded", "reused"):
            continue
        fit = s.ladder_fit()
        if isinstance(fit, dict) and isinstance(fit.get("validation"), dict):
            v = fit["validation"]
            for m, r in (v.get("metrics") or {}).items():
                rows.append((f"{s.name}: {m} at {v.get('name')}",
                             f"predicted {_num(r.get('predicted'))}, actual {_num(r.get('actual'))} "
                             f"({100 * (r.get('rel_error') or 0):+.2f}%)"))
        elif isinstance(fit, dict) and isinstance(fit.get("target"), dict):
            final = {k: d for k, d in fit["target"].items() if k.startswith("final_") and isinstance(d, dict)}
            for k, d in final.items():
                rows.append((f"{s.name}: predicted {k[6:]} of {fit['target'].get('name')}",
                             f"{_num(d.get('value'))} [{_num(d.get('low'))}, {_num(d.get('high'))}]"))
        health = s.health()
        if isinstance(health, dict) and "ok" in health:
            bands = [c for c in health.get("checks") or [] if isinstance(c, dict) and "predicted" in c]
            detail = "; ".join(f"{c.get('name')} {_num(c.get('actual'))} vs predicted {_num(c.get('predicted'))}"
                               for c in bands[:4])
            rows.append((f"{s.name}: health", ("clear" if health["ok"] else "needs a look")
                         + (f" ({detail})" if detail else "")))
        ev = s.eval_results()
        if isinstance(ev, dict) and ev.get("macro_bpb") is not None:
            rows.append((f"{s.name}: eval", f"macro bpb {_num(ev['macro_bpb'])} at step {ev.get('step')}"))
        hr = s.harness_results()
        if isinstance(hr, dict) and hr.get("summary"):
            rows.append((f"{s.name}: harness", "; ".join(f"{t} " + ", ".join(f"{k} {_num(v)}" for k, v in m.items())
                                                         for t, m in hr["summary"].items())))
    return rows


def _card(exp: Experiment) -> str:
    """The experiment card (hypothesis, goal, risks, contingency) with the outcome next to it."""
    card = exp.card or {}
    if not card:
        return ""
    plan = "".join(f"<tr><td>{_e(k)}<td>{_e(card[k])}" for k in CARD_FIELDS if card.get(k))
    outcome = "".join(f"<tr><td>{_e(k)}<td>{_e(v)}" for k, v in outcome_rows(exp))
    return ('<h2 id="card">Experiment card</h2><div class="card"><div><h3>plan</h3><table class="kv">'
            f'{plan}</table></div><div><h3>outcome</h3><table class="kv">{outcome}</table></div></div>')


def _comparison(exp: Experiment) -> str:
    """Training steps overlaid (a ladder's rungs): versioned fields that differ, curves."""
    runs = [s for s in exp.steps if storage.exists(f"{s.output_path}/metrics.jsonl")]
    return comparison_html(runs, title=f"Comparison of {len(runs)} training steps") if len(runs) >= 2 else ""


def _dag(exp: Experiment) -> tuple[str, dict[str, str]]:
    nodes = [dagmod.Node(_anchor(s), s.name, [], {s.state.category: 1}, title=f"{s.name}-{s.hash}")
             for s in exp.steps]
    anchor_of = {s.output_path: _anchor(s) for s in exp.steps}
    for n, s in zip(nodes, exp.steps):
        n.deps = [anchor_of[d] for d in s.dependencies if d in anchor_of]
    member_of: dict[str, str] = {}
    if len(nodes) > dagmod.MAX_NODES:
        nodes, member_of = dagmod.group_nodes(nodes, {n.id: n.label for n in nodes})
        note = (f"<p class=muted>{len(exp.steps)} steps drawn as {len(nodes)} groups by name prefix; "
                "a group's bar shows its steps' statuses, and its link lists them.</p>")
    else:
        note = ""
    legend = '<p class="legend">' + "".join(
        f'<span>{_badge(c)}</span>' for c in CATEGORIES) + "</p>"
    return f'<h2 id="dag-section">DAG</h2>{legend}{note}<div id="dagwrap">{dagmod.draw(nodes)}</div>', member_of


def _step_table(exp: Experiment) -> str:
    rows = []
    for s in exp.steps:
        st = s.state
        holder = st.lease_holder or "-"
        if st.lease_holder and st.lease_age_s is not None:
            holder += f" ({_dur(st.lease_age_s)} since heartbeat)"
        rows.append(f'<tr><td><a href="#{_anchor(s)}">{_e(s.name)}</a><td>{_badge(st.category, st.label)}'
                    f'<td class=mono>{_e(s.hash)}<td class=num>{_dur(s.duration_s)}<td>{_when(s.start_time)}'
                    f'<td>{_when(s.end_time)}<td>{_e(holder)}<td class=mono>{_e(s.output_path)}')
    return ('<h2 id="steps">Steps</h2><table><tr><th>step<th>status<th>hash<th>duration<th>start<th>end'
            '<th>lease holder<th>output path' + "".join(rows) + "</table>")


def _phases(phases: list[dict[str, Any]]) -> str:
    """One row per phase of the run (sequence length x transport): its steps, drops and throughput."""
    if not phases:
        return ""
    rows = "".join(
        f"<tr><td class=num>{_e(p['seq_len'])}<td>{_e(p['transport'])}<td class=num>{_e(p['first_step'])}"
        f"<td class=num>{_e(p['last_step'])}<td class=num>{_pct(p['drop_frac_send'])}"
        f"<td class=num>{_pct(p['drop_frac_recv'])}<td class=num>{_num(p['tokens_per_s'])}"
        f"<td class=num>{_num(p['mfu'])}"
        for p in phases)
    return ("<table><tr><th>seq_len<th>transport<th>first step<th>last step<th>drops (send)<th>drops (recv)"
            "<th>tokens/s<th>mfu" + rows + "</table>")


def _changes(records: list[dict[str, Any]], key: str) -> list[tuple[float, str]]:
    out, prev = [], None
    for r in records:
        v = r.get(key)
        if v is not None and v != prev:
            if prev is not None:
                out.append((r["step"], f"{key.replace('seq_len', 'L')}={v}"))
            prev = v
    return out


def training_plots(records: list[dict[str, Any]], horizon: int | None) -> str:
    """Plots of a training step's records: loss, grad norm, LR, drops, expert load, tokens/s, MFU,
    with sequence-length and transport changes marked; eval curves when eval records exist."""
    train = [r for r in records if r.get("kind", "train") == "train" and "step" in r]
    evals = [r for r in records if r.get("kind") == "eval" and "step" in r]
    markers = _changes(train, "seq_len") + _changes(train, "transport")
    out = []
    if train:
        last = train[-1]
        of = f" of {horizon} ({100 * last['step'] / horizon:.1f}% of horizon)" if horizon else ""
        out.append(f"<p>{len(train):,} records, last step {last['step']}{of}"
                   + (f", L={_e(last.get('seq_len'))} {_e(last.get('transport', ''))}" if 'seq_len' in last else "")
                   + "</p>")
    xs = [r["step"] for r in train]
    for title, keys in TRAIN_PLOTS:
        series = {k: (xs, [r.get(k) for r in train]) for k in keys if any(k in r for r in train[:50] + train[-50:])}
        if series:
            out.append(line_plot(title, series, markers=markers))
    eval_keys = sorted({k for r in evals for k in r if k.startswith("eval/")})
    if eval_keys:
        ex = [r["step"] for r in evals]
        macro = [k for k in eval_keys if "macro" in k or "micro" in k]
        per_set = [k for k in eval_keys if k not in macro and k.endswith("/bpb")]
        task_acc = [k for k in eval_keys if k.startswith(TASK_PREFIX) and k.endswith(("/acc", "/acc_norm"))]
        for title, keys in (("eval bits per byte (macro / micro)", macro), ("eval bits per byte per set", per_set),
                            ("task accuracy (in-training eval)", task_acc)):
            if keys:
                out.append(line_plot(title, {k: (ex, [r.get(k) for r in evals]) for k in keys[:8]}, markers=markers))
    return "".join(out)


def _files(step: Step) -> tuple[str, list[tuple[str, int | None]]]:
    files = step.files()
    if not files:
        return "<p class=muted>no output files</p>", files
    rows = "".join(f"<tr><td class=mono>{_e(n)}<td class=num>{_size(sz)}" for n, sz in files)
    return f"<details><summary>files ({len(files)})</summary><table>{rows}</table></details>", files


def _images(step: Step, files: list[tuple[str, int | None]]) -> str:
    out = []
    for name, size in files:
        if name.endswith(".png") and size is not None and size <= MAX_INLINE_IMAGE:
            with storage.filesystem(step.output_path).open(f"{step.output_path}/{name}", "rb") as f:
                data = base64.b64encode(f.read()).decode()
            out.append(f'<figure><img alt="{_e(name)}" src="data:image/png;base64,{data}" style="max-width:100%">'
                       f"<figcaption>{_e(name)}</figcaption></figure>")
    return "".join(out)


def _config(step: Step) -> str:
    config = step.config
    if config is None:
        return "<p class=muted>no recorded config</p>"
    # a grouped config's fields are recorded as spelled (optimizer.peak_lr) and versioned by leaf name
    versioned = [*step.versioned_fields, *(step.version.get("spelled") or {}).values()]
    rows = []
    for path, value in config_leaves(config):
        v = is_versioned(path, versioned)
        text = json.dumps(value) if not isinstance(value, str) else value
        if len(text) > 300:
            text = text[:297] + "..."
        rows.append(f'<tr{" class=v" if v else ""}><td class=mono>{_e(path or "(config)")}<td class=mono>{_e(text)}')
    return (f"<details><summary>config ({len(rows)} fields; ✓ = versioned, part of the hash)</summary>"
            f"<table>{''.join(rows)}</table></details>")


def _step_section(step: Step, exp: Experiment, dependents: dict[str, list[str]], group: str | None) -> str:
    by_path = exp.by_path()
    st = step.state
    out = [(f'<section class="step" id="{_anchor(step)}"><h3>{_e(step.name)} '
            f'<span class=mono>{_e(step.hash)}</span> {_badge(st.category, st.label)}</h3>')]
    facts = {"output path": step.output_path, "function": step.fn or "-", "duration": _dur(step.duration_s),
             "started": _when(step.start_time), "ended": _when(step.end_time)}
    if step.description:
        facts["about"] = step.description
    if st.lease_holder:
        facts["lease holder"] = st.lease_holder
    if st.advice:
        facts["what to do"] = st.advice
    out.append('<table class="kv">' + "".join(f"<tr><td>{_e(k)}<td>{_e(v)}" for k, v in facts.items()) + "</table>")

    def links(paths: list[str]) -> str:
        items = []
        for p in paths:
            s = by_path.get(p)
            items.append(f'<a href="#{_anchor(s)}">{_e(s.name)}</a>' if s else f"<code>{_e(p)}</code>")
        return ", ".join(items) or "none"

    out.append(f"<p>inputs: {links(step.dependencies)}<br>read by: {links(dependents.get(step.output_path, []))}"
               + (f'<br>group: <a href="#{group}">{_e(group[6:])}</a>' if group else "") + "</p>")
    out.append(_config(step))
    files_html, files = _files(step)
    out.append(files_html)
    names = {n for n, _ in files}
    for o in step_outputs.OUTPUTS:  # the table of step outputs: one entry each, in its order
        if o.html is not None and o.file in names and (data := step.output(o.file)) is not None:
            out.append(f"<h3>{_e(o.title)}</h3>" + o.html(data))
    if "metrics.jsonl" in names:
        records = step.metric_records()
        out.append("<h3>training</h3>" + _phases(phase_summary([r for r in records if r.get("kind", "train") == "train"
                                                                and "step" in r]))
                   + training_plots(records, step.horizon))
    out.append(_images(step, files))
    if step.error or st.category == "failed":
        out.append(f"<h3>error</h3><pre>{_e(step.error or '(no error recorded; see a dependency)')}\n"
                   f"{_e(step.traceback or '')}</pre>")
    out.append("</section>")
    return "".join(out)


def _results(exp: Experiment) -> str:
    """The results of the table of step outputs (health, evaluation, fits, gates, harness) gathered at
    the top (each also in its step's section)."""
    out = []
    for s in exp.steps:
        if s.state.category not in ("succeeded", "reused"):
            continue
        for o in step_outputs.OUTPUTS:
            if o.result and o.html is not None and (data := s.output(o.file)) is not None:
                out.append(f'<h3>{_e(o.title)}: <a href="#{_anchor(s)}">{_e(s.name)}</a></h3>{o.html(data)}')
    return ('<h2 id="results">Results</h2>' + "".join(out)) if out else ""


def render(exp: Experiment) -> str:
    """The report's HTML text (one self-contained document)."""
    dependents = exp.dependents()
    dag_html, member_of = _dag(exp)
    group_of = {s.output_path: member_of.get(_anchor(s)) for s in exp.steps}
    groups: dict[str, list[Step]] = {}
    for s in exp.steps:
        if group_of[s.output_path]:
            groups.setdefault(group_of[s.output_path], []).append(s)
    group_html = "".join(
        f'<section class="step" id="{g}"><h3>group {_e(g[6:])} ({len(members)} steps)</h3><p>'
        + ", ".join(f'<a href="#{_anchor(s)}">{_e(s.name)}</a> {_badge(s.state.category)}' for s in members)
        + "</p></section>" for g, members in groups.items())
    sections = "".join(_step_section(s, exp, dependents, group_of[s.output_path]) for s in exp.steps)
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
            "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">"
            f"<title>marin report: {_e(exp.name)}</title><style>{CSS}</style></head><body><main>"
            f"{_header(exp)}{_card(exp)}{dag_html}{_step_table(exp)}{_results(exp)}{_comparison(exp)}"
            + (f"<h2>Groups</h2>{group_html}" if group_html else "")
            + f"<h2>Step details</h2>{sections}</main><script>{SCRIPT}</script></body></html>")


REPORT_FILE = "report.html"
"""The report's name in a directory given as its output (as ``cp FILE DIR/`` names the copy)."""


def report_path(path: str) -> str:
    """Where a report given ``path`` goes: ``path`` itself, or ``path/report.html`` when ``path`` is
    an existing directory or ends with ``/``. ValueError (one line) when a file stands where a folder
    of the path must be."""
    if path.endswith("/") or (storage.is_local(path) and os.path.isdir(path)):
        path = f"{path.rstrip('/')}/{REPORT_FILE}"
    if storage.is_local(path):
        path = os.path.abspath(path)
        parent = os.path.dirname(path)
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent) if os.path.dirname(parent) != parent else ""
        if parent and not os.path.isdir(parent):
            raise ValueError(f"cannot write the report to {path}: {parent} is a file, not a folder")
    return path


def write_report(exp: Experiment, path: str) -> str:
    """Write the report to ``path`` (local or object store; a directory gets ``report.html``)
    atomically; returns the path written."""
    path = report_path(path)
    text = render(exp)
    if storage.is_local(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    storage.write_text(path, text)
    return path


# --------------------------------------------------------------------------------------------- #
# as an executor step                                                                              #
# --------------------------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    name: str = live("the title in the report's header; the step's own name is in its version")
    """The experiment's name in the report's header."""
    step_paths: list[str] = input_field()
    """Output paths of the steps to report (their upstream steps are found from their records)."""
    output_path: str = input_field()
    description: str | None = live("a caption in the report's header", default=None)


def experiment_from_steps(name: str, step_paths: list[str], prefix: str | None = None,
                          description: str | None = None) -> Experiment:
    """An experiment of ``step_paths`` and every step they read, found from the steps' own records."""

    seen: dict[str, Step] = {}
    todo = list(step_paths)
    while todo:
        p = todo.pop().rstrip("/")
        if p in seen:
            continue
        seen[p] = Step(p)
        todo.extend(seen[p].dependencies)
    steps = dependency_order(list(seen.values()))
    if prefix is None:
        prefix = (
            os.path.commonpath([s.output_path for s in steps])
            if steps and all(storage.is_local(s.output_path) for s in steps)
            else (steps[0].output_path.rsplit("/", 2)[0] if steps else "")
        )
    return Experiment(name, prefix, steps, description)


def report_step(config: ReportConfig) -> str:
    """Write ``report.html`` for the given steps into the step's output (the ``default_report`` step)."""
    exp = experiment_from_steps(config.name, config.step_paths, description=config.description)
    return write_report(exp, f"{config.output_path}/{REPORT_FILE}")
