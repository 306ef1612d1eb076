"""How each step output reads: HTML for the report (``marin report``) and text for ``marin show``,
one renderer per output of the table in :mod:`marin.review.outputs`, and what ``marin show --json``
keeps of the larger ones. Renderers take the output's JSON (a dict) and never read files."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from marin.data.order import format_coverage, repeat_warnings
from marin.monitoring.health import format_report
from marin.review.plots import line_plot
from marin.textfmt import format_table

FILTER_MANIFESTS = ("dedup_manifest.json", "decontamination_manifest.json")
"""The manifests of the steps that filter a corpus (dedup, decontamination)."""


def esc(v: Any) -> str:
    """HTML-escaped text of ``v``."""
    return html.escape(str(v), quote=True)



def num(v: Any) -> str:
    """A number as a person reads it (thousands separated, 4 significant digits); anything else escaped."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return esc(v)
    if isinstance(v, int):
        return f"{v:,}"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"



def pct(x: Any) -> str:
    """A fraction as a percentage with 3 decimals; "-" for anything else."""
    return f"{100 * x:.3f}%" if isinstance(x, (int, float)) and x == x else "-"



def kv(d: dict[str, Any]) -> str:
    """A two-column table of ``d``'s keys and values."""
    return '<table class="kv">' + "".join(
        f"<tr><td>{esc(k)}<td>{num(v) if not isinstance(v, (dict, list)) else esc(json.dumps(v))}"
        for k, v in d.items()) + "</table>"



def checklist_html(report: dict[str, Any]) -> str:
    """A health checklist (``health.json``): the verdict, each check, the summary."""
    out = []
    if "ok" in report:
        out.append(f'<p>overall: <span class="{"ok" if report["ok"] else "alert"}">'
                   f'{"clear" if report["ok"] else "needs a look"}</span></p>')
    checks = report.get("checks") or report.get("checklist") or []
    if isinstance(checks, dict):
        checks = [
            {"name": k, **(v if isinstance(v, dict) else {"ok": bool(v), "detail": v})} for k, v in checks.items()
        ]
    if checks:
        out.append("<table><tr><th>check<th>state<th>detail")
        for c in checks:
            ok = c.get("ok")
            state = "clear" if ok else ("ALERT" if ok is not None else "-")
            out.append(f'<tr><td>{esc(c.get("name"))}<td class="{"ok" if ok else "alert"}">{state}'
                       f'<td>{esc(c.get("detail", ""))}')
        out.append("</table>")
    summary = report.get("summary")
    if isinstance(summary, dict) and summary:
        out.append(kv(summary))
    return "".join(out)



def eval_html(ev: dict[str, Any]) -> str:
    """Evaluation results (``eval.json``): per set documents, tokens, bytes, loss, perplexity, bpb;
    macro and micro bpb."""
    sets = ev.get("sets") or {}
    cols = ["documents", "tokens", "bytes", "loss", "perplexity", "bpb"]
    head = f'<p>step {esc(ev.get("step", "-"))}, checkpoint <code>{esc(ev.get("checkpoint", "-"))}</code></p>'
    rows = "".join(f"<tr><td>{esc(name)}" + "".join(f"<td class=num>{num(v.get(c))}" for c in cols)
                   for name, v in sets.items())
    foot = (f'<tr><th>macro<td colspan=5><td class=num>{num(ev.get("macro_bpb"))}'
            f'<tr><th>micro<td colspan=5><td class=num>{num(ev.get("micro_bpb"))}')
    return head + "<table><tr><th>set" + "".join(f"<th>{c}" for c in cols) + rows + foot + "</table>"



def fit_html(fit: dict[str, Any]) -> str:
    """A scaling-ladder fit (``fit.json``): target, predictions with bands, parameters, validation."""
    out = []
    if fit.get("target") is not None:
        out.append(f"<p>target: <b>{esc(fit['target'])}</b></p>")
    preds = fit.get("predictions") or {}
    if preds:
        out.append("<table><tr><th>fraction<th>loss<th>bpb<th>low<th>high")
        for frac, p in preds.items():
            p = p if isinstance(p, dict) else {"loss": p}
            out.append(f"<tr><td>{esc(frac)}" + "".join(f"<td class=num>{num(p.get(k))}"
                                                      for k in ("loss", "bpb", "low", "high")))
        out.append("</table>")
    if fit.get("params"):
        out.append("<h3>parameters</h3>" + kv(fit["params"]))
    if fit.get("loo_rel_error") is not None:
        out.append(f"<p>leave-one-out relative error: {num(fit['loo_rel_error'])}</p>")
    if isinstance(fit.get("validation"), dict):
        out.append("<h3>predicted vs actual (validation)</h3>" + validation_table(fit["validation"]))
    return "".join(out)



def validation_table(v: dict[str, Any]) -> str:
    """Predicted vs actual for a validation run: loss, bpb (value, band, error, inside) and each
    task's accuracy (error in points)."""
    rows = []
    for m, r in (v.get("metrics") or {}).items():
        inside = r.get("inside")
        rows.append(f"<tr><td>{esc(m)}<td class=num>{num(r.get('predicted'))}<td class=num>{num(r.get('low'))}"
                    f"<td class=num>{num(r.get('high'))}<td class=num>{num(r.get('actual'))}"
                    f"<td class=num>{num(100 * r['rel_error']) if r.get('rel_error') is not None else '-'}%"
                    f"<td>{'-' if inside is None else 'yes' if inside else '<b>no</b>'}")
    for name, t in (v.get("tasks") or {}).items():
        if t.get("acc") is None:
            continue
        inside = t.get("acc_inside")
        pts = t.get("acc_error_points")
        rows.append(f"<tr><td>{esc(name)} accuracy<td class=num>{num(t['acc'])}<td class=num>{num(t.get('acc_low'))}"
                    f"<td class=num>{num(t.get('acc_high'))}<td class=num>{num(t.get('actual_acc'))}"
                    f"<td class=num>{num(pts) if pts is not None else '-'} points"
                    f"<td>{'-' if inside is None else 'yes' if inside else '<b>no</b>'}")
    head = f"<p>validation run <b>{esc(v.get('name', '-'))}</b> (never fitted), {num(v.get('flops'))} FLOPs</p>"
    return (head + "<table><tr><th>metric<th>predicted<th>low<th>high<th>actual<th>error<th>inside band"
            + "".join(rows) + "</table>")



def isoflop_section(doc: dict[str, Any]) -> str:
    """The IsoFLOP parabolas, the surface's iso-loss contours with the runs, the frontier and the
    exponents, the next run, and predicted vs actual for the validation run."""
    m = doc.get("metric", "loss")
    md = (doc.get("metrics") or {}).get(m)
    if not isinstance(md, dict):
        return ""
    runs = doc.get("runs") or []
    out = []
    series, points = {}, {}
    for p in md.get("parabolas", []):
        pts = [r for r in runs if r.get("budget") == p["budget"]]
        xs = sorted(math.log10(r["n"]) for r in pts)
        if not xs:
            continue
        c2, c1, c0 = p["coef"]
        grid = [xs[0] - 0.15 + i * (xs[-1] - xs[0] + 0.3) / 40 for i in range(41)]
        series[f"C={num(p['budget'])}"] = (grid, [c2 * (g * math.log(10)) ** 2 + c1 * g * math.log(10) + c0
                                                     for g in grid])
        points[f"runs C={num(p['budget'])}"] = ([math.log10(r["n"]) for r in pts], [r[m] for r in pts])
    points["optima"] = ([math.log10(p["n_opt"]) for p in md.get("parabolas", [])],
                        [p["loss_opt"] for p in md.get("parabolas", [])])
    v = doc.get("validation")
    if isinstance(v, dict) and m in (v.get("metrics") or {}):
        points[f"validation {v['name']}"] = ([math.log10(v["n"])], [v["metrics"][m]["actual"]])
    out.append(line_plot(f"IsoFLOP parabolas: {m} vs log10 N (active parameters)", series, points=points,
                         height=260))
    s = md.get("surface") or {}
    if all(k in s for k in ("E", "A", "B", "alpha", "beta")) and runs:
        ln = [math.log10(r["n"]) for r in runs]
        lo, hi = min(ln) - 0.3, max(ln) + 0.3
        losses = sorted(r[m] for r in runs)
        contours = {}
        for q in (0.1, 0.35, 0.6, 0.85):
            level = losses[int(q * (len(losses) - 1))]
            xs, ys = [], []
            for i in range(61):
                x = lo + i * (hi - lo) / 60
                rest = level - s["E"] - s["A"] / (10 ** x) ** s["alpha"]
                if rest > 0 and s["beta"] > 0:
                    xs.append(x)
                    ys.append(math.log10((s["B"] / rest) ** (1 / s["beta"])))
            contours[f"{m} = {num(level)}"] = (xs, ys)
        dots = {"runs": (ln, [math.log10(r["d"]) for r in runs]),
                "IsoFLOP optima": ([math.log10(p["n_opt"]) for p in md["parabolas"]],
                                   [math.log10(p["d_opt"]) for p in md["parabolas"]])}
        if isinstance(v, dict):
            dots[f"validation {v['name']}"] = ([math.log10(v["n"])], [math.log10(v["d"])])
        ys_all = [y for _, ys in dots.values() for y in ys]
        y_lo, y_hi = min(ys_all) - 1, max(ys_all) + 1
        kept = {k: [(x, y) for x, y in zip(*c) if y_lo <= y <= y_hi] for k, c in contours.items()}
        contours = {k: ([x for x, _ in pts], [y for _, y in pts]) for k, pts in kept.items()}
        out.append(line_plot(f"loss surface iso-{m} contours: log10 D (tokens) vs log10 N, runs as points",
                             contours, points=dots, height=260))
        out.append(f"<p>surface: {m} = {num(s['E'])} + {num(s['A'])} / N^{num(s['alpha'])} + {num(s['B'])} / "
                   f"D^{num(s['beta'])} (R² {num(s.get('r2'))}; {esc(s.get('why', ''))})</p>")
    f = md.get("frontier") or {}
    ex = md.get("exponents") or {}
    if f:
        cmp = ex.get("beta_over_alpha_plus_beta") or {}
        like = ex.get("surface_slope_under_flops_model") or {}
        out.append(f"<p>frontier: N_opt ∝ C^{num(f.get('a'))} ± {num(f.get('a_std'))}, D_opt ∝ C^{num(f.get('b'))} "
                   f"± {num(f.get('b_std'))} (a + b = {num(f.get('a_plus_b'))}); surface β/(α+β) = "
                   f"{num(cmp.get('surface'))} ± {num(cmp.get('surface_std'))}"
                   + (f", surface N_opt slope under the run's FLOPs {num(like.get('surface'))} ± "
                      f"{num(like.get('surface_std'))}" if like else "")
                   + (" <b>(disagree beyond their uncertainty)</b>" if cmp.get("disagree") or like.get("disagree")
                      else "") + "</p>")
    sel = md.get("selection") or {}
    if sel:
        out.append(f"<p>law for predictions: <b>{esc(sel.get('law'))}</b> ({esc(sel.get('why', ''))})</p>")
    nxt = doc.get("next")
    if isinstance(nxt, dict) and nxt.get("config"):
        c = nxt["config"]
        out.append(f"<p>compute-optimal run at {num(nxt.get('budget'))} FLOPs: d{esc(c['width'])} x "
                   f"{esc(c['layers'])} layers, {esc(c['train_steps'])} steps ({num(c['tokens'])} tokens), predicted "
                   f"{num(c['predicted'])} [{num(c['low'])}, {num(c['high'])}]</p>")
    if isinstance(v, dict):
        out.append("<h3>predicted vs actual (validation)</h3>" + validation_table(v))
    return "".join(out)



def mixture_html(rep: dict[str, Any]) -> str:
    """A mixture report (``mixture_report.json``): effective domain shares and sources per stage."""
    out = []
    for i, stage in enumerate(rep.get("stages") or []):
        out.append(f"<h3>stage {i} (from step {esc(stage.get('start_step', 0))})</h3>")
        if stage.get("domain_shares"):
            out.append("<p>effective domain shares</p><table><tr><th>domain<th>share")
            out.extend(f"<tr><td>{esc(k)}<td class=num>{100 * v:.2f}%" for k, v in
                       sorted(stage["domain_shares"].items(), key=lambda kv: -kv[1]))
            out.append("</table>")
        srcs = [s for s in stage.get("sources") or [] if s.get("share")]
        if srcs:
            out.append("<details><summary>sources with a share</summary><table><tr><th>source<th>share"
                       "<th>train tokens<th>epochs")
            out.extend(f"<tr><td>{esc(s.get('source'))}<td class=num>{100 * s['share']:.2f}%"
                       f"<td class=num>{num(s.get('train_tokens'))}<td class=num>{num(s.get('epochs'))}"
                       for s in sorted(srcs, key=lambda s: -s["share"]))
            out.append("</table></details>")
    if has_coverage(rep):
        out.append(coverage_html(rep["coverage"]))
    return "".join(out)


COVERAGE_COLUMNS = ("epochs", "seen", "repeated", "read tokens", "training tokens")
"""What a coverage row says: epochs over the run, the share of the tokens seen at least once and
seen more than once, the tokens the run reads and the tokens there are."""


def _coverage_cells(r: dict[str, Any]) -> tuple[str, ...]:
    return (f"{r['epochs']:.2f}", f"{100 * r['seen']:.1f}%", f"{100 * r['repeated']:.1f}%",
            f"{r['drawn_tokens']:,.0f}", f"{r['train_tokens']:,.0f}")


def has_coverage(rep: Any) -> bool:
    """A mixture report written with the run's planned tokens (it then says what the run reads)."""
    return isinstance(rep, dict) and isinstance(rep.get("coverage"), dict) and bool(rep["coverage"].get("domains"))


def mixture_coverage(rep: dict[str, Any]) -> dict[str, Any]:
    """What ``marin show --json`` keeps of a mixture report's coverage: all of it (order, planned
    tokens, one row per domain and per source, the repeat warnings)."""
    return rep["coverage"]


def coverage_text(cov: dict[str, Any], most_read_sources: int = 12) -> str:
    """The run's data coverage (:func:`mixture_coverage`): totals, every domain, the
    ``most_read_sources`` sources read most, and a warning per source past the repeat limit."""
    domains, sources = cov["domains"], cov.get("sources") or []
    out = [format_coverage(domains, cov["order"], f"{len(domains)} domains, {len(sources)} sources; "
                           f"{cov.get('total_tokens', 0):,} planned tokens, mixture_report.json", per_domain=None)]
    shown = sorted(sources, key=lambda r: -r["epochs"])[:most_read_sources]
    if shown:
        out.append(f"  sources read most ({len(shown)} of {len(sources)}):")
        out.append(format_table(("source", *COVERAGE_COLUMNS), [(r["source"], *_coverage_cells(r)) for r in shown],
                                right=(1, 2, 3, 4, 5), rule=False, indent="    "))
    return "\n".join(out)


def coverage_html(cov: dict[str, Any]) -> str:
    """The report's data coverage of a mixture: per domain and (folded) per source, how much of it
    the planned run reads and how much more than once, and the repeat warnings by source."""
    head = "".join(f"<th>{esc(c)}" for c in COVERAGE_COLUMNS)

    def table(rows: list[dict[str, Any]], key: str) -> str:
        body = "".join(f"<tr><td>{esc(r[key])}" + "".join(f"<td class=num>{esc(c)}" for c in _coverage_cells(r))
                       for r in sorted(rows, key=lambda r: -r["epochs"]))
        return f"<table><tr><th>{key}{head}{body}</table>"

    domains, sources = cov["domains"], cov.get("sources") or []
    n = sum(r["train_tokens"] for r in domains)
    drawn = sum(r["drawn_tokens"] for r in domains)
    seen = sum(r["seen"] * r["train_tokens"] for r in domains) / n if n else 0.0
    rep = sum(r["repeated"] * r["train_tokens"] for r in domains) / n if n else 0.0
    out = [f"<h3>data coverage (order {esc(cov.get('order'))})</h3><p>the planned {num(cov.get('total_tokens'))} "
           f"tokens read {drawn:,.0f} of {n:,.0f} training tokens ({drawn / n if n else 0:.2f} epochs): "
           f"{100 * seen:.1f}% of them seen, {100 * rep:.1f}% seen more than once</p>"]
    out += [f'<p class="alert">warning: {esc(w)}</p>' for w in repeat_warnings(domains)]
    out.append(table(domains, "domain"))
    if sources:
        out.append(f"<details><summary>per source ({len(sources)})</summary>{table(sources, 'source')}</details>")
    return "".join(out)



def manifest_html(man: dict[str, Any]) -> str:
    """A token store's manifest (``manifest.json``): totals, skipped documents per source."""
    t = man.get("totals") or {}
    out = [kv({k: v for k, v in t.items() if k != "skipped"})]
    skipped = t.get("skipped") or {}
    out.append("<p>skipped documents: " + (", ".join(f"{esc(k)} {v:,}" for k, v in skipped.items()) or "none")
               + "</p>")
    bad = [(n, s) for n, s in (man.get("sources") or {}).items() if s.get("skipped")]
    if bad:
        out.append("<table><tr><th>source<th>skipped")
        out.extend(f"<tr><td>{esc(n)}<td>{esc(json.dumps(s['skipped']))}" for n, s in bad)
        out.append("</table>")
    files = man.get("skipped_files") or []
    out.append(f"<p>corrupt files skipped: {len(files) or 'none'}</p>")
    if files:
        out.append("<table><tr><th>input file<th>source<th>why")
        out.extend(f"<tr><td>{esc(f.get('input_file'))}<td>{esc(f.get('source'))}<td>{esc(f.get('reason'))}"
                   for f in files)
        out.append("</table>")
    return "".join(out)



def corpus_filter_section(man: dict[str, Any]) -> str:
    """A dedup or decontamination manifest: the parameters, a table of removed documents per domain
    with a bar of the share removed, matches per evaluation set, and the sampled removals."""
    p = man.get("params") or {}
    out = [kv({k: v for k, v in p.items() if not isinstance(v, (dict, list))})]
    if man.get("kind") == "dedup":
        out.append(f"<p>{num(man.get('clusters', 0))} duplicate clusters from {num(man.get('candidate_pairs', 0))} "
                   "candidate pairs</p>")
    against = man.get("against") or {}
    if against:
        out.append("<table><tr><th>evaluation set<th>texts<th>too short<th>n-grams<th>training docs matched")
        out.extend(f"<tr><td>{esc(n)}<td class=num>{num(s.get('texts'))}<td class=num>{num(s.get('too_short'))}"
                   f"<td class=num>{num(s.get('ngrams'))}<td class=num>{num(s.get('matched_training_documents'))}"
                   for n, s in against.items())
        out.append("</table>")
    rows = filter_rows(man)
    reasons = list((man.get("totals") or {}).get("removed") or {})
    top = max([r["removed_share"] for r in rows] + [1e-12])
    out.append("<table><tr><th>domain<th>docs in<th>docs out" + "".join(f"<th>{esc(k)}" for k in reasons)
               + "<th>removed<th>")
    for r in rows:
        width = 160 * r["removed_share"] / top
        folded = f" title='{esc(', '.join(r['folded']))}'" if r.get("folded") else ""
        out.append(f"<tr><td{folded}>{esc(r['domain'])}<td class=num>{num(r['documents_in'])}<td class=num>"
                   f"{num(r['documents_out'])}" + "".join(f"<td class=num>{num(r['removed'].get(k, 0))}"
                                                          for k in reasons)
                   + f"<td class=num>{100 * r['removed_share']:.2f}%<td><svg width=160 height=10 class=bar>"
                   f"<rect width={width:.1f} height=10 fill=#d83b3b></rect></svg>")
    out.append("</table>")
    sample = man.get("sample") or []
    if sample:
        out.append(f"<details><summary>{len(sample)} sampled removals</summary><pre>{esc(json.dumps(sample, indent=1))}"
                   "</pre></details>")
    return "".join(out)



def harness_html(rec: dict[str, Any]) -> str:
    """lm-evaluation-harness results (``harness.json``): one row per task and metric."""
    rows = "".join(f"<tr><td>{esc(task)}<td>{esc(metric)}<td class=num>{num(v)}"
                   for task, metrics in (rec.get("summary") or {}).items() for metric, v in metrics.items())
    return f"<p>checkpoint step {esc(rec.get('step'))}</p><table><tr><th>task<th>metric<th>value{rows}</table>"


def train_summary_html(ts: dict[str, Any]) -> str:
    """A training run's summary (``train_summary.json``): its scalar values."""
    return kv({k: v for k, v in ts.items() if not isinstance(v, (dict, list))})


# --------------------------------------------------------------------------------------------- #
# text for marin show                                                                              #
# --------------------------------------------------------------------------------------------- #


def checklist_text(report: dict[str, Any]) -> str:
    """A health checklist for ``marin show`` (another writer's checklist: its checks as written)."""
    try:
        text = format_report(report)
    except (KeyError, TypeError, ValueError):
        checks = report.get("checks") or []
        text = "\n".join(f"  [{'clear' if c.get('ok') else 'ALERT'}] {c.get('name')}: {c.get('detail', '')}"
                         for c in checks if isinstance(c, dict))
        if "ok" in report:
            text += "\noverall: " + ("clear" if report["ok"] else "needs a look")
    return "health checklist (health.json):\n" + text


def mixture_shares(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """What ``marin show --json`` keeps of a mixture report: each stage's start and effective domain shares."""
    return [{"start_step": s.get("start_step", 0), "domain_shares": s.get("domain_shares")}
            for s in rep.get("stages", [])]


def mixture_text(stages: list[dict[str, Any]]) -> str:
    """Effective domain shares per stage (:func:`mixture_shares`), largest first."""
    out = []
    for stage in stages:
        shares = sorted((stage.get("domain_shares") or {}).items(), key=lambda kv: -kv[1])
        out.append(f"effective domain shares from step {stage['start_step']} (mixture_report.json):\n"
                   + format_table(("domain", "share"), [(n, f"{100 * share:.2f}%") for n, share in shares],
                                  right=(1,), rule=False, indent="  "))
    return "\n\n".join(out)


def token_store(man: dict[str, Any]) -> dict[str, Any]:
    """What ``marin show --json`` keeps of a token store's manifest: totals, skipped documents by
    source, and the corrupt input files the corrupt-input policy left out of the store (with why)."""
    return {"totals": man["totals"],
            "skipped_by_source": {n: s["skipped"] for n, s in (man.get("sources") or {}).items() if s.get("skipped")},
            "skipped_files": man.get("skipped_files") or []}


def token_store_text(store: dict[str, Any]) -> str:
    """A token store (:func:`token_store`) in one line, then the sources that skipped documents and
    each corrupt input file left out of the store (a store can be complete and still miss a file)."""
    t = store["totals"]
    skipped = ", ".join(f"{k} {v}" for k, v in (t.get("skipped") or {}).items()) or "none"
    files = store.get("skipped_files") or []
    lines = [f"token store (manifest.json): {t.get('documents', 0):,} documents, {t.get('tokens', 0):,} tokens "
             f"from {t.get('files', 0)} files; skipped documents: {skipped} ({t.get('skipped_bytes', 0):,} bytes); "
             f"corrupt files skipped: {len(files) or t.get('skipped_files') or 'none'}"]
    lines += [f"  {source}: skipped {json.dumps(counts)}" for source, counts in store["skipped_by_source"].items()]
    lines += [f"  corrupt file skipped: {f.get('input_file')} ({f.get('source')}): {f.get('reason')}" for f in files]
    return "\n".join(lines)


def filter_fields(man: dict[str, Any]) -> dict[str, Any]:
    """What ``marin show --json`` keeps of a dedup or decontamination manifest."""
    return {k: man.get(k) for k in ("kind", "params", "totals", "domains", "clusters", "candidate_pairs", "against",
                                    "sample", "skipped_files")}


def eval_text(ev: dict[str, Any]) -> str:
    """Evaluation results: macro and micro bpb, then bpb, loss and tokens per set."""
    rows = [(name, v.get("bpb"), v.get("loss"), v.get("tokens")) for name, v in (ev.get("sets") or {}).items()]
    return (f"evaluation (eval.json) at step {ev.get('step')}: macro bpb {ev.get('macro_bpb')}, "
            f"micro bpb {ev.get('micro_bpb')}\n"
            + format_table(("set", "bpb", "loss", "tokens"), rows, right=(1, 2, 3), rule=False, indent="  "))


def fields_text(title: str, file: str, data: dict[str, Any]) -> str:
    """Any output without a text renderer of its own: its title and file, then its top-level values
    that are not lists or mappings."""
    shown = ", ".join(f"{k} {json.dumps(v)}" for k, v in data.items() if not isinstance(v, (dict, list)))
    return f"{title} ({file})" + (f": {shown}" if shown else "")


def filter_rows(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per domain of a dedup or decontamination manifest, then the total: documents in and
    out, removed per reason, and the share of documents and bytes removed.

    Domains the step left untouched (no document removed, no byte cut) are folded into one row
    (``folded`` names them): on a clean corpus of 40 domains the table would otherwise be 40 rows of
    zeros hiding the few that matter."""
    rows, untouched = [], []
    for name, e in [*(manifest.get("domains") or {}).items(), ("total", manifest.get("totals") or {})]:
        d_in, b_in = e.get("documents_in", 0), e.get("bytes_in", 0)
        row = {"domain": name, "documents_in": d_in, "documents_out": e.get("documents_out", 0),
               "bytes_in": b_in, "bytes_out": e.get("bytes_out", 0), "removed": dict(e.get("removed") or {}),
               "removed_share": (d_in - e.get("documents_out", 0)) / d_in if d_in else 0.0,
               "bytes_removed_share": (b_in - e.get("bytes_out", 0)) / b_in if b_in else 0.0}
        if name != "total" and row["documents_out"] == d_in and row["bytes_out"] == b_in \
                and not any(row["removed"].values()):
            untouched.append(row)
        else:
            rows.append(row)
    if len(untouched) > 1:
        rows.insert(len(rows) - 1, {
            "domain": f"{len(untouched)} domains, nothing removed", "folded": [r["domain"] for r in untouched],
            **{k: sum(r[k] for r in untouched) for k in ("documents_in", "documents_out", "bytes_in", "bytes_out")},
            "removed": {k: 0 for k in untouched[0]["removed"]}, "removed_share": 0.0, "bytes_removed_share": 0.0})
    elif untouched:  # one untouched domain stays a row of its own: folding it would hide its name for nothing
        rows.insert(len(rows) - 1, untouched[0])
    return rows


def filter_text(man: dict[str, Any]) -> str:
    """A dedup or decontamination manifest for ``marin show``: removed documents per domain and
    reason, a few examples."""
    lines: list[str] = []
    t, p = man["totals"], man.get("params") or {}
    if man.get("kind") == "dedup":
        lines.append(f"deduplication (dedup_manifest.json): {p.get('shingle_size')}-word shingles, "
                     f"{p.get('bands')} bands x {p.get('rows')} rows (Jaccard >= {p.get('threshold')}), "
                     f"scope {p.get('scope')}; "
                     f"{man.get('clusters', 0):,} clusters")
    else:
        lines.append(f"decontamination (decontamination_manifest.json): {p.get('ngram')}-grams, mode {p.get('mode')}")
        for name, s in (man.get("against") or {}).items():
            lines.append(f"  {name}: {s.get('texts', 0):,} texts ({s.get('too_short', 0)} too short), "
                         f"{s.get('ngrams', 0):,} n-grams, matched {s.get('matched_training_documents', 0):,} "
                         "training documents")
    reasons = list(t.get("removed") or {})
    domain_rows = filter_rows(man)
    rows = [(r["domain"], f"{r['documents_in']:,}", f"{r['documents_out']:,}",
             *(f"{r['removed'].get(k, 0):,}" for k in reasons), f"{100 * r['removed_share']:.2f}%",
             f"{100 * r['bytes_removed_share']:.2f}%") for r in domain_rows]
    lines.append(format_table(("domain", "docs in", "docs out", *reasons, "docs removed", "bytes removed"), rows,
                              right=tuple(range(1, 5 + len(reasons))), rule=False, indent="  "))
    lines += [f"  nothing removed in: {', '.join(r['folded'])}" for r in domain_rows if r.get("folded")]
    for s in (man.get("sample") or [])[:5]:
        if "kept" in s:
            r, k = s["removed"], s["kept"]
            lines.append(f"  removed {r['source']}/{r['file']}#{r['record']} ({s['reason']}, similarity "
                         f"{s['similarity']}) kept {k['source']}/{k['file']}#{k['record']}")
        else:
            lines.append(f"  removed {s['source']}/{s['file']}#{s['record']} matching {', '.join(s['sets'])}: "
                         f"\"{s['ngram'][:80]}\"")
    if man.get("skipped_files"):
        lines.append(f"  corrupt files skipped: {len(man['skipped_files'])}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- #
# the K40 layout's cluster overview and the domain fit                                          #
# --------------------------------------------------------------------------------------------- #

OVERVIEW_TERMS = 6
"""Top terms shown per domain (the manifest keeps more)."""
OVERVIEW_SAMPLE_CHARS = 240
"""Characters of a sample document shown: enough to tell what a cluster holds, short enough to scan 40."""


def has_overview(data: Any) -> bool:
    """A K40 layout manifest built from raw text (its ``overview``: per domain share, terms, buckets, samples)."""
    return isinstance(data, dict) and isinstance(data.get("overview"), dict) and bool(data["overview"])


def is_domain_fit(data: Any) -> bool:
    """A domain fit's manifest (``domain_fit.json``)."""
    return isinstance(data, dict) and data.get("kind") == "domain_fit" and isinstance(data.get("domains"), list)


def cluster_overview(man: dict[str, Any]) -> dict[str, Any]:
    """What ``marin show --json`` keeps of a K40 layout manifest: where it was built from, how its
    shares are measured, and the overview per domain, largest share first."""
    rows = sorted(man["overview"].items(), key=lambda kv: -(kv[1].get("share") or 0.0))
    return {"built_from": man.get("built_from"), "share_measure": man.get("share_measure"),
            "buckets": man.get("buckets") or [], "totals": man.get("totals"), "domains": dict(rows)}


def _bucket_shares(buckets: dict[str, int], names: list[str]) -> list[float]:
    total = sum(buckets.get(b, 0) for b in names)
    return [buckets.get(b, 0) / total if total else 0.0 for b in names]


def _short(text: str, n: int = OVERVIEW_SAMPLE_CHARS) -> str:
    """One line of at most ``n`` characters (whitespace runs folded)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= n else flat[: n - 3] + "..."


def cluster_overview_text(ov: dict[str, Any]) -> str:
    """The overview (:func:`cluster_overview`) for ``marin show``: a table of each domain's share,
    documents, quality distribution and top terms, then a sample or two per domain."""
    buckets = list(ov.get("buckets") or [])
    bf = ov.get("built_from") or {}
    fit, clf = bf.get("fit") or {}, bf.get("classifier") or {}
    lines = [f"cluster overview (k40_manifest.json): {len(ov['domains'])} domains x {len(buckets)} quality buckets, "
             f"shares of {ov.get('share_measure') or 'bytes'}; fit {fit.get('fit_id', '?')} (k {fit.get('k', '?')}), "
             f"classifier {clf.get('classifier_id', '?')}"]
    rows = [(name, d.get("title", ""), f"{100 * (d.get('share') or 0):.2f}%", f"{d.get('documents', 0):,}",
             " ".join(f"{100 * s:.0f}" for s in _bucket_shares(d.get("buckets") or {}, buckets)),
             ", ".join((d.get("top_terms") or [])[:OVERVIEW_TERMS])) for name, d in ov["domains"].items()]
    lines.append(format_table(("domain", "title", "share", "docs", f"% {'/'.join(buckets)}", "top terms"), rows,
                              right=(2, 3), rule=False, indent="  "))
    lines.append("samples:")
    for name, d in ov["domains"].items():
        for s in (d.get("samples") or [])[:2]:
            lines.append(f"  {name} [{s.get('bucket', '?')}, score {s.get('score', '?')}] "
                         f"{_short(s.get('text', ''), 100)}")
    return "\n".join(lines)


def cluster_overview_html(man: dict[str, Any]) -> str:
    """The overview as the report shows it: per domain its share (a bar), documents, quality
    distribution (one stacked bar over the buckets, q1 lightest), score deciles, top terms, and a
    few samples to open."""
    ov = cluster_overview(man)
    buckets = list(ov["buckets"])
    bf = ov.get("built_from") or {}
    out = [kv({"domains": len(ov["domains"]), "buckets": " ".join(buckets),
               "share of": ov.get("share_measure") or "bytes",
               "fit": (bf.get("fit") or {}).get("fit_id"), "k": (bf.get("fit") or {}).get("k"),
               "classifier": (bf.get("classifier") or {}).get("classifier_id")})]
    top = max([d.get("share") or 0.0 for d in ov["domains"].values()] + [1e-12])
    shades = ["#f2d0a9", "#e8b37c", "#c9a14a", "#7fae5a", "#2f8f4e"]  # q1 (light) .. q5 (dark)
    out.append("<table class=overview><tr><th>domain<th>share<th><th>docs<th>quality "
               + esc(" / ".join(buckets)) + "<th>score p10 / p50 / p90<th>top terms<th>samples")
    for name, d in ov["domains"].items():
        share = d.get("share") or 0.0
        x, segs = 0.0, []
        for i, (b, s) in enumerate(zip(buckets, _bucket_shares(d.get("buckets") or {}, buckets))):
            segs.append(f"<rect x={x:.1f} width={160 * s:.1f} height=10 fill={shades[min(i, len(shades) - 1)]}>"
                        f"<title>{esc(b)} {100 * s:.1f}%</title></rect>")
            x += 160 * s
        q = d.get("score_quantiles") or {}
        quartiles = " / ".join("-" if q.get(p) is None else f"{q[p]:.2f}" for p in ("p10", "p50", "p90"))
        samples = d.get("samples") or []
        sample_html = ("<details><summary>" + f"{len(samples)}</summary>" + "".join(
            f"<p class=sample><b>{esc(s.get('bucket', ''))}</b> {esc(_short(s.get('text', '')))}</p>" for s in samples)
            + "</details>") if samples else ""
        out.append(f"<tr><td>{esc(name)}<br><small>{esc(d.get('title', ''))}</small><td class=num>{100 * share:.2f}%"
                   f"<td><svg width=120 height=10 class=bar><rect width={120 * share / top:.1f} height=10 "
                   f"fill=#3b6fd8></rect></svg><td class=num>{num(d.get('documents', 0))}"
                   f"<td><svg width=160 height=10 class=quality>{''.join(segs)}</svg>"
                   f"<td class=num>{quartiles}"
                   f"<td>{esc(', '.join((d.get('top_terms') or [])[:OVERVIEW_TERMS]))}<td>{sample_html}")
    out.append("</table>")
    return "".join(out)


def domain_fit_text(man: dict[str, Any]) -> str:
    """A domain fit for ``marin show``: K, the sample, the embedding, and per domain its share of the
    sample and its top terms (the layout step's overview adds quality and samples)."""
    e, s = man.get("embedding") or {}, man.get("sample") or {}
    lines = [f"domain fit (domain_fit.json): k {man.get('k')}, fit {man.get('fit_id')}, embedding {e.get('model')} "
             f"({e.get('dims')} dims), sample {s.get('documents', 0):,} of {s.get('corpus_documents', 0):,} documents"]
    rows = [(d.get("name"), d.get("title", ""), f"{100 * (d.get('sample_share') or 0):.2f}%",
             ", ".join((d.get("top_terms") or [])[:OVERVIEW_TERMS])) for d in man["domains"]]
    lines.append(format_table(("domain", "title", "sample share", "top terms"), rows, right=(2,), rule=False,
                              indent="  "))
    return "\n".join(lines)


def domain_fit_html(man: dict[str, Any]) -> str:
    """A domain fit in the report: its settings and, per domain, its sample share (a bar) and top terms."""
    e, s = man.get("embedding") or {}, man.get("sample") or {}
    out = [kv({"k": man.get("k"), "fit": man.get("fit_id"), "embedding": e.get("model"), "dims": e.get("dims"),
               "sample documents": s.get("documents"), "corpus documents": s.get("corpus_documents")})]
    top = max([d.get("sample_share") or 0.0 for d in man["domains"]] + [1e-12])
    out.append("<table><tr><th>domain<th>sample share<th><th>top terms")
    out.extend(f"<tr><td>{esc(d.get('name'))}<td class=num>{100 * (d.get('sample_share') or 0):.2f}%<td><svg width=120 "
               f"height=10 class=bar><rect width={120 * (d.get('sample_share') or 0) / top:.1f} height=10 "
               f"fill=#3b6fd8></rect></svg><td>{esc(', '.join((d.get('top_terms') or [])[:OVERVIEW_TERMS]))}"
               for d in man["domains"])
    out.append("</table>")
    return "".join(out)
