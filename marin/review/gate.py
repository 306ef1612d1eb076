"""A paired gate's ``gate.json`` and a run's cutovers, as ``marin show`` prints them and the report draws them.

A gate (:mod:`marin.training.gate`) trains a live run's control and candidates from one checkpoint on
identical batches; its file holds per arm the window's step time, MFU, drops, loss, grad norm and peak
memory, and per candidate the paired loss difference with its interval and the verdict. A run's
cutovers (``TrainConfig.cutovers``) name the gate each live change rests on; its transport switches
are cutovers too, with or without a gate.
"""

from __future__ import annotations

import html
import math
from typing import Any

from marin.review.plots import line_plot
from marin.textfmt import format_table
from marin.training.config import Cutover
from marin.training.cutover import cutover_evidence
from marin.training.gate import CONTROL


def _num(x: Any, spec: str = ".4g") -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return "-"
    return format(v, spec) if math.isfinite(v) else str(v)


def _gib(x: Any) -> str:
    return f"{float(x) / 2**30:.1f} GiB" if isinstance(x, (int, float)) and x else "not reported"


def gate_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per arm: changes, status, median step time (spread), MFU, drops (send/recv), mean loss,
    max grad norm, paired loss difference [interval], speedup, peak memory."""
    rows = []
    for label, arm in (doc.get("arms") or {}).items():
        t = arm.get("step_time") or {}
        paired = arm.get("paired_loss_delta") or {}
        changes = ", ".join(f"{k}={v}" for k, v in (arm.get("changes") or {}).items()) or "(the run's own)"
        rows.append((label, changes, str(arm.get("status")),
                     f"{_num(t.get('median_s'), '.3f')} s (±{_num(100 * _f(t.get('spread')), '.0f')}%)",
                     f"{_num(100 * _f(arm.get('mfu')), '.2f')}%",
                     f"{_num(arm.get('drop_frac_send'), '.2e')}/{_num(arm.get('drop_frac_recv'), '.2e')}",
                     _num(arm.get("loss_mean"), ".4f"), _num(arm.get("grad_norm_max"), ".3f"),
                     (f"{_num(paired.get('mean'), '+.4f')} [{_num(paired.get('low'), '+.4f')}, "
                      f"{_num(paired.get('high'), '+.4f')}]") if label != CONTROL else "-",
                     f"{_num(arm.get('speedup'), '.3f')}x" if label != CONTROL else "-",
                     _gib(arm.get("peak_memory_bytes"))))
    return rows


GATE_COLUMNS = ("arm", "changes", "status", "step time", "MFU", "drops send/recv", "loss", "max gnorm",
                "loss vs control", "speedup", "peak memory")


def _f(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def format_gate(doc: dict[str, Any]) -> str:
    """``marin show`` of a gate step: where the arms started, the arms' table and each verdict line."""
    head = (f"paired gate (gate.json) of {doc.get('run')} at step {doc.get('at_step')}, steps "
            f"{doc.get('window', ['?', '?'])[0]}-{doc.get('window', ['?', '?'])[1]}; identical batches: "
            f"{'yes' if doc.get('identical_batches') else 'NO'}")
    lines = [head]
    if doc.get("pool_note"):
        lines.append(f"  {doc['pool_note']}")
    lines.append(format_table(GATE_COLUMNS, gate_rows(doc), right=(3, 4, 5, 6, 7, 8, 9, 10), rule=False,
                              indent="  "))
    for label, arm in (doc.get("arms") or {}).items():
        if isinstance(arm.get("verdict"), dict):
            lines.append(f"  {label}: {arm['verdict'].get('line')}")
    return "\n".join(lines)


def gate_html(doc: dict[str, Any]) -> str:
    """The report's section of a gate: the arms' table, each verdict, and the arms' loss and step-time
    curves (steps that compiled left out of the step times)."""
    e = html.escape
    head = "".join(f"<th>{e(c)}" for c in GATE_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{e(str(v))}" for v in row) for row in gate_rows(doc))
    verdicts = "".join(
        f"<li><b>{e(label)}</b>: {e(str(arm['verdict'].get('line')))}" for label, arm in (doc.get("arms") or {}).items()
        if isinstance(arm.get("verdict"), dict))
    arms = doc.get("arms") or {}
    loss = {k: (a.get("steps") or [], [_f(x) for x in a.get("loss") or []]) for k, a in arms.items()}
    times = {k: ([s for s, c in zip(a.get("steps") or [], a.get("compiled") or []) if not c],
                 [_f(t) for t, c in zip(a.get("step_time_s") or [], a.get("compiled") or []) if not c])
             for k, a in arms.items()}
    note = f"<p>{e(doc['pool_note'])}</p>" if doc.get("pool_note") else ""
    return (f"<p>{e(str(doc.get('run')))} at step {e(str(doc.get('at_step')))} ({e(str(doc.get('checkpoint')))}); "
            f"identical batches: {'yes' if doc.get('identical_batches') else 'no'}</p>{note}"
            f"<table><tr>{head}{body}</table><ul>{verdicts}</ul>"
            + line_plot("loss per arm (identical batches)", loss, y_label="loss")
            + line_plot("step time per arm", times, y_label="s"))


def cutovers(config: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A training run's cutovers from its config record: every transport switch after step 0 and every
    recorded ``cutovers`` entry, by step, each with the gate it rests on and that gate's verdict (or
    none recorded)."""
    if not isinstance(config, dict):
        return []
    recorded = [Cutover(**c) for c in config.get("cutovers") or [] if isinstance(c, dict)]
    switches = [(int(s), str(t)) for s, t in ((config.get("parallelism") or {}).get("transport_switches") or [])]
    out: dict[int, dict[str, Any]] = {}
    previous = switches[0][1] if switches else None
    for step, transport in switches:
        if step > 0:
            out[step] = {"step": step, "change": f"transport {previous} -> {transport}", "gate": None}
        previous = transport
    for c in recorded:
        entry = out.setdefault(c.step, {"step": c.step, "change": None, "gate": None})
        entry["gate"] = cutover_evidence(c, config)
    return [out[s] for s in sorted(out)]


def cutover_lines(config: dict[str, Any] | None) -> list[str]:
    """``marin show``'s lines for a run's cutovers (:func:`cutovers`)."""
    lines = []
    for c in cutovers(config):
        g = c["gate"]
        change = c["change"] or ", ".join(f"{k}={v}" for k, v in ((g or {}).get("changes") or {}).items()) or "?"
        if g is None:
            evidence = "no gate recorded"
        else:
            verdict = {True: "pass", False: "FAILED"}.get(g["pass"], "no verdict yet")
            evidence = (f"gate {g['gate']} candidate {g['candidate']}: {verdict}"
                        + (f", but it does not back this change: it {g['mismatch']}" if g.get("mismatch") else "")
                        + (" (applied anyway: forced)" if g["forced"] else ""))
        lines.append(f"step {c['step']:,}: {change}; {evidence}")
    return lines


def gate_comparison(docs: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    """``marin compare`` of gate steps: one row per candidate of each gate (name -> its gate.json):
    where it started, the changes, the paired loss difference [interval], the speedup, the fraction
    dropped and the verdict."""
    rows = []
    for name, doc in docs.items():
        for label, arm in (doc.get("arms") or {}).items():
            if label == CONTROL or not isinstance(arm.get("verdict"), dict):
                continue
            paired = arm.get("paired_loss_delta") or {}
            rows.append((name, label, str(doc.get("at_step")),
                         ", ".join(f"{k}={v}" for k, v in (arm.get("changes") or {}).items()),
                         f"{_num(paired.get('mean'), '+.4f')} [{_num(paired.get('low'), '+.4f')}, "
                         f"{_num(paired.get('high'), '+.4f')}]", f"{_num(arm.get('speedup'), '.3f')}x",
                         _num(_f(arm.get("drop_frac_send")) + _f(arm.get("drop_frac_recv")), ".2e"),
                         "pass" if arm["verdict"].get("pass") else "FAIL"))
    return rows


GATE_COMPARISON_COLUMNS = ("gate", "candidate", "at step", "changes", "loss vs control", "speedup", "dropped",
                           "verdict")
