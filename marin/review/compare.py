"""Putting runs side by side: which versioned config fields differ, and their curves overlaid.

``marin compare RUN_OR_STEP ...`` prints the differences (and writes an HTML page with ``-o``); the
report of an experiment with several training steps (a ladder's rungs) has a comparison section.
Curves are loss, bits per byte (in-training eval), grad norm and drop fraction (sender side) against
step, tokens and training FLOPs (tokens x FLOPs per token at each record's sequence length, summed
record by record, so a sequence-length phase change bends the FLOP axis as it bends the cost).
"""

from __future__ import annotations

import html
import json
from typing import Any

from marin.execution.hashing import plain
from marin.execution.jsonable import from_jsonable
from marin.models.config import MoEConfig, flops_per_token
from marin.review import Step
from marin.review.gate import GATE_COMPARISON_COLUMNS, gate_comparison
from marin.review.plots import line_plot
from marin.review.steps import TRAIN_STEPS_KEYS, train_horizon
from marin.textfmt import format_table
from marin.training.gate import GATE_FILE
from marin.training.run import Run

CURVES = (("loss", "loss", "train"), ("bpb (macro, eval)", "eval/macro_bpb", "eval"),
          ("grad norm", "grad_norm", "train"), ("drop fraction (send)", "drop_frac_send", "train"))
AXES = ("step", "tokens", "flops")


def differing_fields(steps: list[Step]) -> dict[str, list[Any]]:
    """Versioned field path -> value per step, for the fields whose values are not all equal (a field
    one step lacks counts as different; its value shows as None). Values are compared as encoded
    (``1`` and ``1.0`` differ, as they do for the hash) and shown plain (``3.0``, not ``{"float": "3.0"}``)."""
    fields = [s.versioned_fields for s in steps]
    keys = sorted({k for f in fields for k in f})
    out = {}
    for k in keys:
        values = [f.get(k) for f in fields]
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) > 1:
            out[k] = [plain(v) for v in values]
    return out


def is_training_run(step: Step) -> bool:
    """Whether a step trains: it wrote ``metrics.jsonl`` or its config has a training horizon of its
    own (``train_steps``). A step that reads a run (a health report's ``total_steps``) does not train."""
    return bool(step.metric_records()) or train_horizon(step.config, keys=TRAIN_STEPS_KEYS) is not None


def check_one_kind(steps: list[Step]) -> None:
    """Refuse to put a training run beside a step that does not train (its eval step, say), or steps
    that run different functions: every versioned field would differ and no curve would line up.
    ValueError (one line) naming the odd steps."""
    training = [is_training_run(s) for s in steps]
    if any(training) and not all(training):
        odd = ", ".join(f"[{i + 1}] {s.name}-{s.hash}" + (f" ({s.fn})" if s.fn else "")
                        for i, (s, t) in enumerate(zip(steps, training)) if not t)
        raise ValueError(f"{odd}: not a training run (no metrics.jsonl, no train_steps in its config); compare "
                         "training runs with training runs")
    kinds = {s.fn for s in steps if s.fn}
    if len(kinds) > 1 and not all(training):
        listed = ", ".join(f"[{i + 1}] {s.name}-{s.hash} runs {s.fn or 'an unrecorded function'}"
                           for i, s in enumerate(steps))
        raise ValueError(f"cannot compare steps of different kinds: {listed}; compare steps that run one function")


def _flops_per_token(step: Step):
    """``seq_len -> training FLOPs per token`` of the step's model, or None without a model config."""
    model = step.config.get("model") if isinstance(step.config, dict) else None
    if not isinstance(model, dict):  # a run started without the executor: its checkpoints record it
        model = (Run(step.output_path).recorded_config or {}).get("model")
    if not isinstance(model, dict):
        return None
    try:
        cfg = from_jsonable(MoEConfig, model)
    except ValueError:  # a model record this version cannot read: no FLOP axis, the rest still compares
        return None
    cache: dict[int, float] = {}
    return lambda n: cache.setdefault(int(n), flops_per_token(cfg, int(n)))


def curves(step: Step) -> dict[str, dict[str, list[float]]]:
    """{metric key: {"step", "tokens", "flops", "value": [...]}} of a training step's metrics."""
    records = step.metric_records()
    fpt = _flops_per_token(step)
    train = [r for r in records if r.get("kind", "train") == "train" and "step" in r]
    # FLOPs at each training record, then looked up by step for eval records
    flops_at: dict[int, float] = {}
    tokens_at: dict[int, int] = {}
    total, prev_tokens = 0.0, 0
    for r in train:
        tokens = int(r.get("tokens") or 0)
        if fpt is not None and r.get("seq_len"):
            total += (tokens - prev_tokens) * fpt(r["seq_len"])
        prev_tokens = tokens
        flops_at[int(r["step"])] = total if fpt is not None else float("nan")
        tokens_at[int(r["step"])] = tokens
    out: dict[str, dict[str, list[float]]] = {}
    for _, key, kind in CURVES:
        rows = [r for r in records if r.get("kind", "train") == kind and key in r and "step" in r]
        if not rows:
            continue
        out[key] = {"step": [r["step"] for r in rows],
                    "tokens": [r.get("tokens", tokens_at.get(int(r["step"]))) for r in rows],
                    "flops": [flops_at.get(int(r["step"]), float("nan")) for r in rows],
                    "value": [r[key] for r in rows]}
    return out


def compare(steps: list[Step]) -> dict[str, Any]:
    """What ``marin compare`` shows: names, differing versioned fields, last values and curves."""
    names = [f"{s.name}-{s.hash}" for s in steps]
    per_step = [curves(s) for s in steps]
    last = {}
    for _, key, _ in CURVES:
        vals = [c[key]["value"][-1] if key in c else None for c in per_step]
        if any(v is not None for v in vals):
            last[key] = vals
    gates = {n: doc for n, s in zip(names, steps) if isinstance(doc := s.read_json(GATE_FILE), dict)}
    return {"steps": names, "paths": [s.output_path for s in steps], "differences": differing_fields(steps),
            "last": last, "curves": {n: c for n, c in zip(names, per_step)}, "gates": gate_comparison(gates)}


def format_comparison(result: dict[str, Any]) -> str:
    """A text table: differing fields and last values, one column per step ([1], [2], ...)."""
    names = result["steps"]
    rows = [(k, *[v if isinstance(v, str) else json.dumps(v, default=str) for v in values])
            for k, values in result["differences"].items()]
    if not rows:
        rows.append(("(no versioned field differs)", *[""] * len(names)))
    rows += [(f"last {k}", *[None if v is None else f"{v:.4g}" for v in values])
             for k, values in result["last"].items()]
    legend = "\n".join(f"[{i + 1}] {n}" for i, n in enumerate(names))
    text = legend + "\n\n" + format_table(["field", *[f"[{i + 1}]" for i in range(len(names))]], rows)
    if result.get("gates"):  # paired gates: each candidate's evidence side by side
        text += "\n\n" + format_table(GATE_COMPARISON_COLUMNS, result["gates"])
    return text


def comparison_html(steps: list[Step], *, title: str = "Comparison") -> str:
    """The report's comparison section: the differing fields table and overlaid SVG curves against
    step, tokens and FLOPs (empty string for fewer than two training steps)."""
    runs = [s for s in steps if s.metric_records()]
    if len(runs) < 2:
        return ""
    result = compare(runs)
    e = html.escape
    head = "".join(f"<th>{e(n)}" for n in result["steps"])
    body = "".join(f"<tr><td>{e(k)}" + "".join(f"<td>{e(json.dumps(v, default=str))}" for v in vals)
                   for k, vals in result["differences"].items())
    body += "".join(f"<tr><td>last {e(k)}" + "".join(f"<td class=num>{'-' if v is None else f'{v:.4g}'}"
                                                    for v in vals) for k, vals in result["last"].items())
    out = [f'<h2 id="comparison">{e(title)}</h2><table><tr><th>versioned field{head}{body}</table>']
    for label, key, _ in CURVES:
        for axis in AXES:
            series = {n: (c[key][axis], c[key]["value"]) for n, c in result["curves"].items() if key in c}
            if series:
                out.append(line_plot(f"{label} vs {axis}", series, height=170))
    return "".join(out)
