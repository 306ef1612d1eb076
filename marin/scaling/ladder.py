"""The ladder fit step: read the rungs' training (and evaluation) outputs, fit scaling laws, predict
the target's trajectory, and write ``fit.json`` plus PNG plots.

What is read per rung (its step directories):
  * ``metrics.jsonl`` training records: ``loss``, ``grad_norm``, ``drop_frac_send``/``drop_frac_recv``
    by step, and in-training evaluation records (``"kind": "eval"``, ``eval/macro_bpb``) when the run
    evaluated while training;
  * ``eval.json`` of its evaluation step when one is given: the final ``macro_bpb``.
A rung's value **at fraction f** of its run is the mean over training records whose step lies within
``WINDOW`` (1%) of the run around ``round(f * steps)`` (clipped to the run; at f = 1 that is the last
1%); bpb at f is the in-training eval record nearest to that step (within 5% of the run), and the
final bpb is ``eval.json``'s when present. Compute at f, ``C_f``, is the FLOPs spent up to that step
(:func:`marin.scaling.recipe.run_flops` over the phases so far).

Per fraction, ``L_f(C_f) = E + A * C_f**-alpha`` is fitted across rungs (:mod:`marin.scaling.fit`;
the saturating or the pure law as :func:`marin.scaling.fit.select_law` decides, by leave-largest-out)
and evaluated at the target's ``C_f``: a predicted trajectory with bands. When every rung's eval.json
carries multiple-choice tasks, each task's accuracy is predicted through its task loss
(:mod:`marin.scaling.tasks`). Grad norm: each rung's
smoothed curve (rolling mean over 2% of the run), its peak value and peak position after the warmup
(as a fraction of the run), and the trend of both over log10(C). Drop fractions at the same
fractions, with their trend. Leave-one-out: the final-value fit without the largest rung, predicting it.

The check against a validation rung uses the same function with ``validation`` set: the validation
rung is never part of any fit; its final value is compared with the prediction at its own compute.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np

from marin.execution.versioning import by_field, input_field, live
from marin.models.config import MoEConfig, count_params
from marin.runsteps import phase_steps
from marin.scaling.fit import (
    FitError,
    fit_selected_law,
    leave_largest_out,
    linear_trend,
    trend_predict,
    within_band,
)
from marin.scaling.recipe import run_flops
from marin.scaling.tasks import fit_task_laws, predict_task, verify_task
from marin.training.metrics import read_metrics

logger = logging.getLogger(__name__)

FRACTIONS = (0.03, 0.1, 0.3, 0.5, 1.0)
WINDOW = 0.01
"""Half-width of the averaging window around a fraction, as a fraction of the run."""
GRAD_NORM_SMOOTH = 0.02
"""Rolling-mean width for the grad-norm curve, as a fraction of the run."""
EVAL_MATCH = 0.05
"""An in-training eval record counts for fraction f when it lies within this fraction of the run."""


class LadderFitError(ValueError):
    """Inputs a ladder fit cannot use (missing metrics, too few rungs)."""


@dataclasses.dataclass(frozen=True)
class RungRun:
    """One rung (or the target, or the validation rung) as the fit sees it: its model and schedule,
    and where its outputs are (None for a target that has not run)."""

    name: str
    model: MoEConfig
    train_steps: int
    tokens_per_step: int
    seq_len_phases: tuple[tuple[float, int], ...]
    warmup_steps: int = 0
    run_path: str | None = input_field(default=None)
    eval_path: str | None = input_field(default=None)

    def flops_until(self, step: int) -> float:
        """Training FLOPs of the first ``step`` steps (phases placed on the full run)."""
        step = max(0, min(step, self.train_steps))
        total = 0.0
        done = 0
        for n_steps, seq_len in phase_steps(self.train_steps, self.seq_len_phases):
            take = max(0, min(n_steps, step - done))
            total += run_flops(self.model, take, self.tokens_per_step, ((0.0, seq_len),)) if take else 0.0
            done += n_steps
        return total

    @property
    def flops(self) -> float:
        return run_flops(self.model, self.train_steps, self.tokens_per_step, self.seq_len_phases)


@dataclasses.dataclass(frozen=True)
class LadderFitConfig:
    rungs: tuple[RungRun, ...] = by_field("each rung's fields are versioned leaves (rungs[0].train_steps)")
    target: RungRun = by_field("the target's model and schedule as versioned leaves")
    output_path: str = input_field()
    validation: RungRun | None = by_field("the held-out rung's fields as versioned leaves", default=None)
    fractions: tuple[float, ...] = FRACTIONS
    n_boot: int = 400
    max_validation_rel_error: float | None = live(
        "a pass/fail threshold checked on the finished fit; it changes no output file", default=None)
    """When set, the step fails (after writing fit.json) if the validation rung's final value is
    further than this from the prediction."""


# ----------------------------------------------------------------------------------------------
# reading a rung (pure given the records)


def _num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v


def split_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, in-training eval records), each sorted by step."""
    train = sorted((r for r in records if r.get("kind", "train") == "train" and "loss" in r), key=lambda r: r["step"])
    evals = sorted((r for r in records if r.get("kind") == "eval"), key=lambda r: r["step"])
    return train, evals


def window_mean(train: list[dict[str, Any]], key: str, step: int, total_steps: int, width: float = WINDOW) -> float:
    """Mean of ``key`` over records with step in ``[step - w, step + w]`` (w = width x run, >= 1 step)."""
    w = max(1, round(width * total_steps))
    vals = [_num(r.get(key)) for r in train if abs(r["step"] - step) <= w]
    vals = [v for v in vals if math.isfinite(v)]
    return float(np.mean(vals)) if vals else float("nan")


def smoothed(
    train: list[dict[str, Any]], key: str, total_steps: int, width: float = GRAD_NORM_SMOOTH
) -> tuple[np.ndarray, np.ndarray]:
    """(steps, centred rolling mean of ``key`` over ``width`` of the run)."""
    steps = np.array([r["step"] for r in train], dtype=float)
    vals = np.array([_num(r.get(key)) for r in train], dtype=float)
    if not len(steps):
        return steps, vals
    w = max(1, round(width * total_steps / 2))
    out = np.array([np.nanmean(vals[max(0, i - w): i + w + 1]) for i in range(len(vals))])
    return steps, out


def grad_norm_shape(train: list[dict[str, Any]], total_steps: int, warmup_steps: int) -> dict[str, float]:
    """Peak of the smoothed grad norm after warmup (and after the first 2% of the run, where the
    initial transient lives): value and position as a fraction of the run; also the overall max."""
    steps, gn = smoothed(train, "grad_norm", total_steps)
    if not len(steps):
        return {"peak": float("nan"), "peak_fraction": float("nan"), "max": float("nan")}
    after = steps > max(warmup_steps, GRAD_NORM_SMOOTH * total_steps)
    if not after.any():
        after = np.ones_like(steps, dtype=bool)
    i = int(np.nanargmax(np.where(after, gn, -np.inf)))
    raw = np.array([_num(r.get("grad_norm")) for r in train])
    return {"peak": float(gn[i]), "peak_fraction": float(steps[i] / total_steps), "max": float(np.nanmax(raw))}


def rung_values(run: RungRun, records: list[dict[str, Any]], final_eval: dict[str, Any] | None,
                fractions: Sequence[float]) -> dict[str, Any]:
    """Everything the fit needs from one rung: values at each fraction, final values, grad-norm shape."""
    train, evals = split_records(records)
    if not train:
        raise LadderFitError(f"rung {run.name}: no training records in {run.run_path}/metrics.jsonl")
    last = train[-1]["step"]
    if last < run.train_steps:
        raise LadderFitError(
            f"rung {run.name}: metrics stop at step {last} of {run.train_steps}; the run is unfinished"
        )
    at: dict[str, dict[str, float]] = {}
    for f in fractions:
        step = max(1, round(f * run.train_steps))
        row = {"step": step, "flops": run.flops_until(step)}
        for key in ("loss", "grad_norm", "drop_frac_send", "drop_frac_recv"):
            row[key] = window_mean(train, key, step, run.train_steps)
        row["bpb"] = float("nan")
        if evals:
            near = min(evals, key=lambda r: abs(r["step"] - step))
            if abs(near["step"] - step) <= EVAL_MATCH * run.train_steps:
                row["bpb"] = _num(near.get("eval/macro_bpb"))
        at[_fkey(f)] = row
    final = {
        "loss": at[_fkey(1.0)]["loss"]
        if 1.0 in fractions
        else window_mean(train, "loss", run.train_steps, run.train_steps),
        "bpb": float("nan"),
    }
    if final_eval is not None:
        final["bpb"] = _num(final_eval.get("macro_bpb"))
    elif 1.0 in fractions:
        final["bpb"] = at[_fkey(1.0)]["bpb"]
    if 1.0 in fractions and math.isfinite(final["bpb"]):
        at[_fkey(1.0)]["bpb"] = final["bpb"]
    out = {"name": run.name, "flops": run.flops, "train_steps": run.train_steps, "at": at, "final": final,
           "n": float(count_params(run.model)["active_params"]), "d": float(run.train_steps * run.tokens_per_step),
           "grad_norm_shape": grad_norm_shape(train, run.train_steps, run.warmup_steps),
           "curve": _curve(train, run.train_steps)}
    if final_eval is not None and final_eval.get("tasks"):
        out["tasks"] = final_eval["tasks"]
    return out


def _curve(train: list[dict[str, Any]], total_steps: int, points: int = 200) -> dict[str, list[float]]:
    """A thinned copy of the loss and smoothed grad-norm curves, for the plots."""
    steps, gn = smoothed(train, "grad_norm", total_steps)
    idx = np.unique(np.linspace(0, len(train) - 1, min(points, len(train))).round().astype(int))
    return {"fraction": [float(steps[i] / total_steps) for i in idx],
            "loss": [_num(train[i]["loss"]) for i in idx], "grad_norm": [float(gn[i]) for i in idx],
            "drop_frac_send": [_num(train[i].get("drop_frac_send")) for i in idx]}


def _fkey(f: float) -> str:
    return f"{f:g}"


# ----------------------------------------------------------------------------------------------
# the fit (pure given rung values)


def _fit_metric(cs: list[float], ys: list[float], n_boot: int) -> Any:
    pts = [(c, y) for c, y in zip(cs, ys) if math.isfinite(y) and y > 0]
    if len(pts) < 2:
        return None
    return fit_selected_law([c for c, _ in pts], [y for _, y in pts], n_boot=n_boot)


def fit_ladder(
    rungs: list[dict[str, Any]], target: RungRun, fractions: Sequence[float], n_boot: int = 400
) -> dict[str, Any]:
    """The fit document (``fit.json`` without validation) from :func:`rung_values` of every rung."""
    if len(rungs) < 2:
        raise LadderFitError(f"a ladder fit needs at least 2 rungs, got {len(rungs)}")
    metrics = ["loss"] + (["bpb"] if all(math.isfinite(r["final"]["bpb"]) for r in rungs) else [])
    primary = metrics[-1]
    target_at = {_fkey(f): target.flops_until(max(1, round(f * target.train_steps))) for f in fractions}
    params: dict[str, Any] = {"at": {}}
    predictions: dict[str, dict[str, Any]] = {}
    for f in fractions:
        k = _fkey(f)
        cs = [r["at"][k]["flops"] for r in rungs]
        pred: dict[str, Any] = {"step": max(1, round(f * target.train_steps)), "flops": target_at[k]}
        params["at"][k] = {}
        for m in ("loss", "bpb"):
            fit = _fit_metric(cs, [r["at"][k][m] for r in rungs], n_boot)
            if fit is None:
                continue
            lo, hi = fit.band(target_at[k])
            pred.update({m: float(fit.predict(target_at[k])), f"{m}_low": lo, f"{m}_high": hi})
            params["at"][k][m] = fit.to_json()
        m = primary if primary in pred else "loss"
        pred.update({"metric": m, "low": pred.get(f"{m}_low"), "high": pred.get(f"{m}_high")})
        for key in ("drop_frac_send", "drop_frac_recv", "grad_norm"):
            t = linear_trend([math.log10(c) for c in cs], [r["at"][k][key] for r in rungs])
            pred[key] = trend_predict(t, math.log10(target_at[k])) if t["n"] else float("nan")
        predictions[k] = pred
    final_fits = {}
    loo: dict[str, Any] = {}
    cs = [r["flops"] for r in rungs]
    for m in metrics:
        ys = [r["final"][m] for r in rungs]
        fit = _fit_metric(cs, ys, n_boot)
        if fit is None:
            continue
        final_fits[m] = fit
        params[m] = fit.to_json()
        if len(rungs) >= 3:
            try:
                loo[m] = leave_largest_out(cs, ys, n_boot=max(50, n_boot // 4))
            except FitError as e:
                loo[m] = {"error": str(e)}
    log_cs = [math.log10(c) for c in cs]
    shapes = [r["grad_norm_shape"] for r in rungs]
    gn_pos = linear_trend(log_cs, [s["peak_fraction"] for s in shapes])
    gn_peak = linear_trend(log_cs, [math.log10(s["peak"]) if s["peak"] > 0 else float("nan") for s in shapes])
    log_ct = math.log10(target.flops)
    target_doc = {"name": target.name, "flops": target.flops, "train_steps": target.train_steps,
                  "flops_at": target_at}
    for m, fit in final_fits.items():
        lo, hi = fit.band(target.flops)
        target_doc[f"final_{m}"] = {"value": float(fit.predict(target.flops)), "low": lo, "high": hi}
    tasks = fit_task_laws(rungs, n_boot=max(20, n_boot // 4)) if all(r.get("tasks") for r in rungs) else {}
    target_n = float(count_params(target.model)["active_params"])
    target_d = float(target.train_steps * target.tokens_per_step)
    task_doc = {name: {**{k: v for k, v in e.items() if not k.startswith("_")},
                       "target": predict_task(e, target_n, target_d, target.flops)} for name, e in tasks.items()}
    return {
        "_fits": final_fits,
        "_tasks": tasks,
        "tasks": task_doc,
        "target": target_doc,
        "metric": primary,
        "fractions": [float(f) for f in fractions],
        "predictions": predictions,
        "params": params,
        "loo": loo,
        "loo_rel_error": loo.get(primary, {}).get("rel_error"),
        "grad_norm": {
            "per_rung": [{"name": r["name"], "flops": r["flops"], **r["grad_norm_shape"]} for r in rungs],
            "peak_fraction_trend": gn_pos,
            "log10_peak_trend": gn_peak,
            "predicted_peak_fraction": min(1.0, max(0.0, trend_predict(gn_pos, log_ct))),
            "predicted_peak": 10 ** trend_predict(gn_peak, log_ct),
        },
        "drop_frac": {k: {"per_rung": [r["at"][k]["drop_frac_send"] for r in rungs],
                          "predicted": predictions[k]["drop_frac_send"]} for k in predictions},
        "rungs": [{k: v for k, v in r.items() if k != "curve"} for r in rungs],
    }


def check_validation(doc: dict[str, Any], validation: dict[str, Any], validation_run: RungRun,
                     n_boot: int = 400) -> dict[str, Any]:
    """Compare a validation rung (never fitted) with the fits' prediction at its own compute."""
    out: dict[str, Any] = {"name": validation["name"], "flops": validation["flops"], "metrics": {}}
    for m in ("loss", "bpb"):
        if m not in doc["params"]:
            continue
        fit_json = doc["params"][m]
        actual = validation["final"][m]
        pred = fit_json["E"] + fit_json["A"] * validation["flops"] ** -fit_json["alpha"]
        out["metrics"][m] = {"predicted": pred, "actual": actual, "rel_error": (pred - actual) / actual,
                             "form": fit_json["form"]}
        fit = doc.get("_fits", {}).get(m)
        if fit is not None:
            lo, hi = fit.band(validation["flops"])
            out["metrics"][m].update({"low": lo, "high": hi, "inside": within_band(lo, actual, hi)})
    out["tasks"] = {}
    for name, entry in doc.get("_tasks", {}).items():
        got = (validation.get("tasks") or {}).get(name)
        if not got:
            continue
        out["tasks"][name] = verify_task(entry, validation["n"], validation["d"], validation["flops"], got)
    m = doc["metric"] if doc["metric"] in out["metrics"] else "loss"
    out["rel_error"] = out["metrics"].get(m, {}).get("rel_error")
    out["metric"] = m
    return out


# ----------------------------------------------------------------------------------------------
# plots


def save_png(fig: Any, output_path: str, name: str) -> str:
    """Write matplotlib figure ``fig`` as ``{output_path}/{name}`` (any fsspec path) and close it;
    returns ``name``. The one PNG writer of the ladder's and the IsoFLOP's plots."""
    import matplotlib.pyplot as plt  # matplotlib: the plots extra (slow to import), only when drawing

    with fsspec.open(f"{output_path.rstrip('/')}/{name}", "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return name


def finish_plot(ax: Any, output_path: str, name: str, *, xlabel: str, ylabel: str, title: str) -> str:
    """Label, title and legend ``ax`` as every ladder and IsoFLOP plot is, then write its figure
    (:func:`save_png`); returns ``name``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return save_png(ax.figure, output_path, name)


def write_plots(doc: dict[str, Any], curves: dict[str, dict[str, list[float]]], output_path: str) -> list[str]:
    """PNG plots next to fit.json; returns their file names. Agg backend: no display needed."""
    import matplotlib  # matplotlib: the plots extra (slow to import), only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the Agg backend)

    names = []

    def save(ax, name, **labels):
        names.append(finish_plot(ax, output_path, name, **labels))

    m = doc["metric"]
    rungs = doc["rungs"]
    # 1. final value vs compute, with the fit, its band and the target (and validation)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    cs = np.array([r["flops"] for r in rungs])
    ys = np.array([r["final"][m] for r in rungs])
    ax.scatter(cs, ys, color="C0", zorder=3, label="rungs (fitted)")
    if m in doc["params"]:
        p = doc["params"][m]
        grid = np.logspace(math.log10(cs.min()) - 0.2, math.log10(max(doc["target"]["flops"], cs.max())) + 0.2, 100)
        ax.plot(grid, p["E"] + p["A"] * grid ** -p["alpha"], color="C0",
                label=f"fit: {p['E']:.3g} + {p['A']:.3g} C^-{p['alpha']:.3g} (R²={p['r2']:.3f})")
        t = doc["target"][f"final_{m}"]
        ax.errorbar([doc["target"]["flops"]], [t["value"]], yerr=[[t["value"] - t["low"]], [t["high"] - t["value"]]],
                    fmt="s", color="C1", capsize=4, label=f"target {doc['target']['name']} (predicted)")
    v = doc.get("validation")
    if v and m in v["metrics"]:
        ax.scatter([v["flops"]], [v["metrics"][m]["actual"]], marker="*", s=140, color="C3", zorder=4,
                   label=f"validation {v['name']}: {100 * v['metrics'][m]['rel_error']:+.1f}%")
    ax.set_xscale("log")
    save(ax, f"fit_{m}.png", xlabel="training compute C (FLOPs)", ylabel=f"final {m}", title="final value vs compute")

    # 2. predicted trajectory of the target with bands, and every rung's curve
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, c in curves.items():
        ax.plot(c["fraction"], c["loss"], lw=0.8, alpha=0.7, label=name)
    fr = [float(k) for k in doc["predictions"]]
    lo = [doc["predictions"][k].get("loss_low", np.nan) for k in doc["predictions"]]
    hi = [doc["predictions"][k].get("loss_high", np.nan) for k in doc["predictions"]]
    mid = [doc["predictions"][k].get("loss", np.nan) for k in doc["predictions"]]
    ax.fill_between(fr, lo, hi, color="k", alpha=0.15)
    ax.plot(fr, mid, "ko-", label=f"predicted {doc['target']['name']}")
    ax.set_xscale("log")
    save(ax, "trajectory.png", xlabel="fraction of the run", ylabel="training loss (nats/token)",
         title="loss trajectory: rungs and the prediction")

    # 3. grad norm shape
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, (name, c) in enumerate(curves.items()):
        ax.plot(c["fraction"], c["grad_norm"], lw=0.9, color=f"C{i % 10}", label=name)
    for i, s in enumerate(doc["grad_norm"]["per_rung"]):
        ax.plot([s["peak_fraction"]], [s["peak"]], "v", color=f"C{i % 10}")
    ax.axvline(doc["grad_norm"]["predicted_peak_fraction"], color="k", ls="--",
               label=f"predicted peak for target: {100 * doc['grad_norm']['predicted_peak_fraction']:.0f}%")
    save(ax, "grad_norm.png", xlabel="fraction of the run", ylabel="grad norm (smoothed)",
         title="grad-norm shape per rung")

    # 4. drop fraction
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, c in curves.items():
        ax.plot(c["fraction"], [100 * x for x in c["drop_frac_send"]], lw=0.8, label=name)
    ax.axhline(8.0, color="r", ls="--", label="healthy < 8%")
    save(ax, "drops.png", xlabel="fraction of the run", ylabel="drop fraction, send side (%)",
         title="token drops per rung")
    return names


# ----------------------------------------------------------------------------------------------
# the executor step


def _read_json(path: str) -> dict[str, Any]:
    with fsspec.open(path, "r") as f:
        return json.load(f)


def read_fit_inputs(run_path: str | None, eval_path: str | None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(every metrics.jsonl record of a training step, its evaluation step's eval.json or None)."""
    if run_path is None:
        raise LadderFitError("a fitted run needs its training step's output path (run_path)")
    final_eval = _read_json(f"{eval_path.rstrip('/')}/eval.json") if eval_path else None
    return read_metrics(run_path, kind=None), final_eval


def _load(run: RungRun, fractions: Sequence[float]) -> dict[str, Any]:
    if run.run_path is None:
        raise LadderFitError(f"rung {run.name} has no run_path")
    records, final_eval = read_fit_inputs(run.run_path, run.eval_path)
    return rung_values(run, records, final_eval, fractions)


def ladder_fit_step(config: LadderFitConfig) -> dict[str, Any]:
    """Executor step: write ``fit.json`` and the plots (see the module docstring)."""
    fractions = tuple(sorted(set(config.fractions) | {1.0}))
    rungs = [_load(r, fractions) for r in config.rungs]
    doc = fit_ladder(rungs, config.target, fractions, config.n_boot)
    curves = {r["name"]: r["curve"] for r in rungs}
    if config.validation is not None:
        val = _load(config.validation, fractions)
        doc["validation"] = check_validation(doc, val, config.validation, config.n_boot)
        doc["validation_rel_error"] = doc["validation"]["rel_error"]
        curves[f"{val['name']} (validation)"] = val["curve"]
    doc["plots"] = write_plots(doc, curves, config.output_path)
    with fsspec.open(f"{config.output_path.rstrip('/')}/fit.json", "w") as f:
        json.dump(clean_json({k: v for k, v in doc.items() if not k.startswith("_")}), f, indent=1)
    err = doc.get("validation_rel_error")
    limit = config.max_validation_rel_error
    if limit is not None and err is not None and not abs(err) <= limit:
        raise LadderFitError(f"validation rung {config.validation.name}: {doc['metric']} predicted "
                             f"{doc['validation']['metrics'][doc['validation']['metric']]['predicted']:.4f}, got "
                             f"{doc['validation']['metrics'][doc['validation']['metric']]['actual']:.4f} "
                             f"({100 * err:+.1f}%, limit {100 * limit:.0f}%)")
    return {"fit": f"{config.output_path.rstrip('/')}/fit.json", "loo_rel_error": doc["loo_rel_error"],
            "validation_rel_error": err}


def clean_json(x: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python, NaN/inf (a value a rung did not have) to null."""
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def read_fit(path: str) -> dict[str, Any]:
    """A ``fit.json`` (its path, or the fit step's directory)."""
    if not path.rstrip("/").endswith(".json"):
        path = f"{path.rstrip('/')}/fit.json"
    return _read_json(path)
