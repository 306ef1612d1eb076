"""Task accuracy predicted through task loss, in two steps (Bhagia et al. 2024, "Establishing Task
Scaling Laws via Compute-Efficient Model Ladders").

Per multiple-choice task, every run contributes its accuracy and its *task loss*: the correct
choice's bits per byte (``gold_bpb`` in eval.json's ``tasks``, :mod:`marin.evaluation.multiple_choice`).

1. task loss against scale: a loss surface in (N, D) when the runs separate N and D (an IsoFLOP
   grid), else the law :func:`marin.scaling.fit.select_law` picks against compute (a ladder, where
   every rung has the same tokens per parameter);
2. accuracy against task loss: :class:`marin.scaling.fit.SigmoidFit`, from chance up to 1.

A prediction chains them: the task loss predicted for the run (with its band), then the accuracy
at that loss. The accuracy band is the task-loss band's ends mapped through the sigmoid, widened in
quadrature by the sigmoid's own residual scatter (Student's t on n - 2 degrees of freedom).
"""

from __future__ import annotations

import math
from typing import Any

from marin.scaling.fit import (
    FitError,
    LossSurfaceFit,
    fit_accuracy_sigmoid,
    fit_loss_surface,
    fit_selected_law,
    within_band,
)


def fit_task_laws(runs: list[dict[str, Any]], *, n_boot: int = 100) -> dict[str, Any]:
    """Per task present in every run (each run a dict with ``n``, ``d``, ``flops`` and eval.json's
    ``tasks``): the two fits of the module docstring. Private ``_loss`` / ``_acc`` entries hold the
    fit objects for :func:`predict_task`; the rest is JSON."""
    names = set.intersection(*[set((r.get("tasks") or {}).keys()) for r in runs]) if runs else set()
    out = {}
    for name in sorted(names):
        rows = [r["tasks"][name] for r in runs]
        tl = [float(t["gold_bpb"]) for t in rows if t.get("gold_bpb") is not None]
        if len(tl) != len(rows):
            continue
        acc = [float(t["acc"]) for t in rows]
        entry: dict[str, Any] = {"chance": float(rows[0]["chance"])}
        try:
            surf = fit_loss_surface([r["n"] for r in runs], [r["d"] for r in runs], tl, n_boot=n_boot)
            entry["task_loss"] = {"law": "surface", **surf.to_json()}
            entry["_loss"] = surf
        except FitError as e:
            f = fit_selected_law([r["flops"] for r in runs], tl, n_boot=n_boot)
            entry["task_loss"] = {"law": f.form, "surface_error": str(e), **f.to_json()}
            entry["_loss"] = f
        try:
            sig = fit_accuracy_sigmoid(tl, acc, entry["chance"])
            entry["accuracy"] = sig.to_json()
            entry["_acc"] = sig
        except FitError as e:
            entry["accuracy"] = {"error": str(e)}
        out[name] = entry
    return out


def predict_task(entry: dict[str, Any], n: float, d: float, flops: float) -> dict[str, Any]:
    """Chain the two steps: predicted task loss (and band) at the run, then accuracy (and band: the
    task-loss band's ends through the sigmoid, widened by the sigmoid's residual scatter)."""
    from scipy.stats import t as student_t  # scipy: the train extra, only when fitting

    f = entry["_loss"]
    if isinstance(f, LossSurfaceFit):
        tl, (tl_lo, tl_hi) = float(f.predict(n, d)), f.band(n, d)
    else:
        tl, (tl_lo, tl_hi) = float(f.predict(flops)), f.band(flops)
    out = {"task_loss": tl, "task_loss_low": tl_lo, "task_loss_high": tl_hi}
    sig = entry.get("_acc")
    if sig is not None:
        acc = float(sig.predict(tl))
        q = float(student_t.ppf(0.975, max(1, sig.n - 2)))
        lo_prop, hi_prop = acc - float(sig.predict(tl_hi)), float(sig.predict(tl_lo)) - acc
        lo = acc - math.sqrt(lo_prop ** 2 + (q * sig.resid_std) ** 2)
        hi = acc + math.sqrt(hi_prop ** 2 + (q * sig.resid_std) ** 2)
        out.update({"acc": acc, "acc_low": max(0.0, lo), "acc_high": min(1.0, hi)})
    return out


def verify_task(entry: dict[str, Any], n: float, d: float, flops: float, measured: dict[str, Any]) -> dict[str, Any]:
    """A validation run's task prediction (:func:`predict_task`) next to what it measured
    (``measured``: the task's eval record, ``acc`` and ``gold_bpb``): the error in accuracy points and
    whether accuracy and task loss fell inside their bands."""
    p = predict_task(entry, n, d, flops)
    row = {**p, "actual_task_loss": measured.get("gold_bpb"), "actual_acc": measured.get("acc")}
    if "acc" in p and measured.get("acc") is not None:
        row["acc_error_points"] = 100 * (p["acc"] - measured["acc"])
        row["acc_inside"] = within_band(p["acc_low"], measured["acc"], p["acc_high"])
    if measured.get("gold_bpb") is not None:
        row["task_loss_inside"] = within_band(p["task_loss_low"], measured["gold_bpb"], p["task_loss_high"])
    return row
