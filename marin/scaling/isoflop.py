"""IsoFLOP: for a set of compute budgets, several model sizes each; the compute-optimal size per
budget; the frontier N_opt(C), D_opt(C); a loss surface; and the compute-optimal rung for a new budget.

Chinchilla's approach 2 (Hoffmann et al. 2022): at each budget C the loss of the sizes tried is a
parabola in log N; its minimum is N_opt(C) (and D_opt(C) the tokens that budget buys at that size,
interpolated in log-log between the runs of the budget, so the project's own FLOPs per token are
kept). Across budgets, ``log N_opt = log k + a log C`` and ``log D_opt = log k' + b log C``; with
C proportional to N D, a + b = 1. The loss surface (:func:`marin.scaling.fit.fit_loss_surface`,
approach 3) fitted on every run gives a second estimate, ``beta / (alpha + beta)``; both are reported
and a disagreement beyond their combined uncertainty is flagged.

**Uncertainty of a budget's N_opt**: the parabola's least-squares covariance, with the residual
variance pooled over every budget (each budget alone has 4 - 3 = 1 residual degree of freedom);
parameter draws from that normal give draws of N_opt and D_opt. The exponents' standard deviations
are those of the slopes refitted to each draw, added in quadrature to the slope's own regression
standard error when there are three or more budgets.

**Which law predicts** (fixed here before any validation run is seen): leave the largest budget out,
refit each candidate on the rest, and predict that budget's measured optimum (the minimum of its own
parabola, at its N_opt and D_opt); the smaller ``|log(predicted / measured)|`` wins, a tie within 1e-4
goes to the law with fewer parameters. Candidates: the loss surface, and the pure and saturating laws
of the optimum's loss against C (the saturating one only with 4 budgets left after leaving one out).
The chosen law's band is its linearised prediction interval with Student's t (:mod:`marin.scaling.fit`).

:func:`predict_optimal_config` turns a fit into a run the recipe allows: every allowed width (its
depth by the recipe's rule) trained for the steps the budget buys, the one of least predicted loss.

Pure numpy/scipy (and matplotlib for the PNGs); no JAX.
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
from marin.models.config import MoEConfig, count_params, flops_per_token
from marin.scaling.fit import (
    FitError,
    LossSurfaceFit,
    PowerLawFit,
    fit_loss_surface,
    fit_power_law,
    within_band,
)
from marin.scaling.ladder import clean_json, finish_plot, read_fit_inputs, window_mean
from marin.scaling.recipe import Rung, RunShape, ladder_rungs, run_flops, rung_model
from marin.scaling.tasks import fit_task_laws, predict_task, verify_task

logger = logging.getLogger(__name__)

N_DRAWS = 400
TIE = 1e-4
LAW_PARAMS = {"pure": 2, "saturating": 3, "surface": 5}


# ----------------------------------------------------------------------------------------------
# parabolas per budget and the frontier


@dataclasses.dataclass(frozen=True)
class Parabola:
    """``loss = c2 x^2 + c1 x + c0`` with x = ln N, at one budget."""

    budget: float
    coef: tuple[float, float, float]
    cov: np.ndarray = dataclasses.field(repr=False, compare=False)
    n_opt: float = 0.0
    d_opt: float = 0.0
    loss_opt: float = 0.0
    n_opt_log_std: float = float("nan")
    d_slope: tuple[float, float] = (0.0, 0.0)
    """ln D = d_slope[0] ln N + d_slope[1] within the budget."""
    n_range: tuple[float, float] = (0.0, 0.0)
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"budget": self.budget, "coef": list(self.coef), "n_opt": self.n_opt, "d_opt": self.d_opt,
                "loss_opt": self.loss_opt, "n_opt_log_std": self.n_opt_log_std, "d_slope": list(self.d_slope),
                "n_range": list(self.n_range), "why": self.why}


def _group(budgets, n, d, loss) -> dict[float, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    b, n, d, y = (np.asarray(v, dtype=float) for v in (budgets, n, d, loss))
    if not (b.shape == n.shape == d.shape == y.shape) or b.ndim != 1:
        raise FitError(f"budgets, N, D and loss must be four lists of one length, got {b.shape}, {n.shape}, "
                       f"{d.shape}, {y.shape}")
    for name, v in (("budget", b), ("N", n), ("D", d), ("loss", y)):
        if not np.all(np.isfinite(v)) or np.any(v <= 0):
            raise FitError(f"{name} must be finite and positive, got {v.tolist()}")
    out = {}
    for c in sorted(set(b.tolist())):
        m = b == c
        if len(set(n[m].tolist())) < 3:
            raise FitError(f"budget {c:.3g} has {len(set(n[m].tolist()))} model size(s); a parabola in log N needs "
                           "at least 3 (add sizes on both sides of the expected optimum)")
        out[c] = (n[m], d[m], y[m])
    if len(out) < 2:
        raise FitError(f"an IsoFLOP fit needs at least 2 budgets, got {len(out)}")
    return out


def fit_parabolas(budgets: Sequence[float], n: Sequence[float], d: Sequence[float],
                  loss: Sequence[float]) -> list[Parabola]:
    """One parabola in ln N per budget (see the module docstring); a budget whose parabola opens
    downward (no minimum) is a :class:`FitError`; a minimum outside the sizes tried is noted in ``why``."""
    groups = _group(budgets, n, d, loss)
    fits = []
    ss, dof = 0.0, 0
    for c, (nn, dd, yy) in groups.items():
        x = np.log(nn)
        X = np.stack([x ** 2, x, np.ones_like(x)], axis=1)
        coef, *_ = np.linalg.lstsq(X, yy, rcond=None)
        ss += float(np.sum((yy - X @ coef) ** 2))
        dof += len(x) - 3
        fits.append((c, x, X, coef, nn, dd, yy))
    s2 = ss / dof if dof > 0 else float("nan")
    out = []
    rng = np.random.default_rng(0)
    for c, x, X, coef, nn, dd, _ in fits:
        c2, c1, c0 = (float(v) for v in coef)
        if c2 <= 0:
            raise FitError(f"budget {c:.3g}: the loss has no minimum over the sizes tried (the parabola in log N "
                           f"opens downward, curvature {c2:.3g}); add sizes on both sides of the optimum")
        x_opt = -c1 / (2 * c2)
        slope, icpt = np.polyfit(x, np.log(dd), 1)
        cov = s2 * np.linalg.pinv(X.T @ X) if math.isfinite(s2) else np.full((3, 3), np.nan)
        log_std = float("nan")
        if np.all(np.isfinite(cov)):
            draws = rng.multivariate_normal(coef, cov, size=N_DRAWS, method="svd")
            ok = draws[:, 0] > 0
            xo = -draws[ok, 1] / (2 * draws[ok, 0])
            log_std = float(np.std(xo)) if ok.sum() > 1 else float("nan")
        lo, hi = float(nn.min()), float(nn.max())
        n_opt = math.exp(x_opt)
        why = "minimum inside the sizes tried"
        if not lo <= n_opt <= hi:
            why = (f"minimum N={n_opt:.4g} outside the sizes tried [{lo:.4g}, {hi:.4g}]: extrapolated; add a size "
                   "beyond it")
        out.append(Parabola(budget=c, coef=(c2, c1, c0), cov=cov, n_opt=n_opt,
                            d_opt=math.exp(slope * x_opt + icpt), loss_opt=c0 - c1 ** 2 / (4 * c2),
                            n_opt_log_std=log_std, d_slope=(float(slope), float(icpt)), n_range=(lo, hi), why=why))
    return out


def _slope(log_c: np.ndarray, log_v: np.ndarray) -> tuple[float, float, float]:
    """(slope, intercept, slope standard error; nan with 2 points)."""
    slope, icpt = np.polyfit(log_c, log_v, 1)
    if len(log_c) < 3:
        return float(slope), float(icpt), float("nan")
    resid = log_v - (slope * log_c + icpt)
    s2 = float(np.sum(resid ** 2)) / (len(log_c) - 2)
    se = math.sqrt(s2 / float(np.sum((log_c - log_c.mean()) ** 2)))
    return float(slope), float(icpt), se


def frontier(parabolas: Sequence[Parabola]) -> dict[str, Any]:
    """``N_opt = k C**a`` and ``D_opt = k' C**b`` across budgets, with standard deviations."""
    log_c = np.log([p.budget for p in parabolas])
    a, ln_k, a_se = _slope(log_c, np.log([p.n_opt for p in parabolas]))
    b, ln_kd, b_se = _slope(log_c, np.log([p.d_opt for p in parabolas]))
    rng = np.random.default_rng(1)
    a_draws, b_draws = [], []
    for _ in range(N_DRAWS):
        xs, ds = [], []
        for p in parabolas:
            sd = p.n_opt_log_std if math.isfinite(p.n_opt_log_std) else 0.0
            x = math.log(p.n_opt) + sd * rng.standard_normal()
            xs.append(x)
            ds.append(p.d_slope[0] * x + p.d_slope[1])
        a_draws.append(np.polyfit(log_c, xs, 1)[0])
        b_draws.append(np.polyfit(log_c, ds, 1)[0])

    def combine(draws, se):
        parts = [float(np.std(draws))] + ([se] if math.isfinite(se) else [])
        return math.sqrt(sum(v ** 2 for v in parts))

    sum_draws = np.array(a_draws) + np.array(b_draws)
    return {"a": a, "a_std": combine(a_draws, a_se), "k": math.exp(ln_k), "b": b, "b_std": combine(b_draws, b_se),
            "k_d": math.exp(ln_kd), "a_plus_b": a + b, "a_plus_b_std": float(np.std(sum_draws)),
            "budgets": [p.budget for p in parabolas]}


def compare_exponents(front: dict[str, Any], surface: LossSurfaceFit, *, surface_a: float | None = None,
                      surface_a_std: float | None = None) -> dict[str, Any]:
    """The IsoFLOP exponent ``a`` against the surface's: ``beta / (alpha + beta)`` (the exponent under
    C proportional to N D) and, when given, the surface's own N_opt(C) slope under the run's FLOPs
    model (like for like when FLOPs per token are not 6 N). ``disagree`` is
    ``|difference| > 1.96 x sqrt(sd_1^2 + sd_2^2)``: beyond their combined 95% uncertainty."""

    def one(x: float, sx: float) -> dict[str, Any]:
        comb = math.sqrt(front["a_std"] ** 2 + (sx if math.isfinite(sx) else 0.0) ** 2)
        diff = front["a"] - x
        return {"surface": x, "surface_std": sx, "difference": diff, "combined_std": comb,
                "disagree": bool(abs(diff) > 1.96 * comb) if math.isfinite(comb) and comb > 0 else None}

    out = {"isoflop_a": front["a"], "isoflop_a_std": front["a_std"],
           "beta_over_alpha_plus_beta": one(surface.exponent_n, surface.exponent_n_std)}
    if surface_a is not None:
        out["surface_slope_under_flops_model"] = one(surface_a, surface_a_std if surface_a_std is not None
                                                     else float("nan"))
    return out


# ----------------------------------------------------------------------------------------------
# from a fit to the next run


@dataclasses.dataclass(frozen=True)
class RecipeSpace:
    """What a compute-optimal run may be: the recipe's target and schedule shape, its batch, the widths
    it allows and the depth at each (the recipe's depth rule, as ``(width, layers)`` pairs)."""

    target: MoEConfig
    shape: RunShape
    batch_sequences: int
    widths: tuple[int, ...]
    depths: tuple[tuple[int, int], ...]

    def rung(self, width: int, flops: float, name: str = "d{d}") -> Rung:
        return ladder_rungs(self.target, [width], shape=self.shape, depths=dict(self.depths),
                            batch_sequences=self.batch_sequences, budgets={width: flops}, name=name)[0]

    def flops_per_token_of(self):
        """FLOPs per token as a function of active parameters N, interpolated in log-log over the
        allowed widths (the FLOPs model :meth:`LossSurfaceFit.optimal_allocation` takes)."""
        ns, fs = [], []
        seq = self.shape.base_seq_len
        for w in self.widths:
            m = rung_model(self.target, w, dict(self.depths)[w])
            ns.append(math.log(count_params(m)["active_params"]))
            fs.append(math.log(flops_per_token(m, seq)))
        order = np.argsort(ns)
        ns, fs = np.array(ns)[order], np.array(fs)[order]

        def fpt(n: float) -> float:
            x = math.log(n)
            if x <= ns[0]:
                slope = (fs[1] - fs[0]) / (ns[1] - ns[0])
                return math.exp(fs[0] + slope * (x - ns[0]))
            if x >= ns[-1]:
                slope = (fs[-1] - fs[-2]) / (ns[-1] - ns[-2])
                return math.exp(fs[-1] + slope * (x - ns[-1]))
            return math.exp(float(np.interp(x, ns, fs)))

        return fpt


@dataclasses.dataclass(frozen=True)
class OptimalConfig:
    """The compute-optimal rung the recipe allows at a budget, and what the fit predicts for it."""

    rung: Rung
    n: float
    """Active (non-embedding) parameters."""
    d: float
    """Training tokens."""
    predicted: float
    low: float
    high: float
    candidates: tuple[tuple[int, float], ...]
    """(width, predicted loss) of every width considered."""

    def describe(self) -> str:
        r = self.rung
        return (f"d{r.model.d_model} x {r.model.n_layers} layers, {r.train_steps} steps x {r.tokens_per_step} tokens "
                f"({self.d:.3g} tokens, N={self.n:.3g}, {r.flops:.3g} FLOPs): predicted {self.predicted:.4f} "
                f"[{self.low:.4f}, {self.high:.4f}]")

    def to_json(self) -> dict[str, Any]:
        r = self.rung
        return {"width": r.model.d_model, "layers": r.model.n_layers, "train_steps": r.train_steps,
                "tokens_per_step": r.tokens_per_step, "tokens": r.tokens, "flops": r.flops, "n": self.n,
                "d": self.d, "predicted": self.predicted, "low": self.low, "high": self.high,
                "candidates": [list(c) for c in self.candidates]}


def predict_optimal_config(fit: LossSurfaceFit, flops: float, recipe: RecipeSpace) -> OptimalConfig:
    """The rung of least predicted loss among the recipe's widths at ``flops`` (each at its depth, for
    the steps the budget buys at the recipe's batch), with the surface's prediction band."""
    if not (flops > 0 and math.isfinite(flops)):
        raise FitError(f"compute must be finite and positive, got {flops}")
    best = None
    cands = []
    for w in recipe.widths:
        rung = recipe.rung(w, flops)
        if rung.train_steps < 2:
            continue
        n, d = float(rung.active_params), float(rung.tokens)
        pred = float(fit.predict(n, d))
        cands.append((w, pred))
        if best is None or pred < best[1]:
            best = (rung, pred, n, d)
    if best is None:
        raise FitError(f"no width of {list(recipe.widths)} gets 2 or more steps from {flops:.3g} FLOPs")
    rung, pred, n, d = best
    lo, hi = fit.band(n, d)
    return OptimalConfig(rung=rung, n=n, d=d, predicted=pred, low=lo, high=hi, candidates=tuple(cands))


def surface_from_json(doc: dict[str, Any]) -> LossSurfaceFit:
    return LossSurfaceFit.from_json(doc)


# ----------------------------------------------------------------------------------------------
# the analysis (pure given the runs' values)


def _surface_slope(surface: LossSurfaceFit, budgets: Sequence[float], fpt) -> tuple[float, float]:
    """The surface's N_opt(C) slope over ``budgets`` under the FLOPs model ``fpt``, and its bootstrap sd."""
    log_c = np.log(budgets)

    def slope_of(s: LossSurfaceFit) -> float:
        return float(np.polyfit(log_c, [math.log(s.optimal_allocation(c, fpt)[0]) for c in budgets], 1)[0])

    main = slope_of(surface)
    draws = []
    for theta in surface.boot[:100]:
        s = dataclasses.replace(surface, theta=theta, E=math.exp(theta[2]), A=math.exp(theta[0]),
                                B=math.exp(theta[1]), alpha=float(theta[3]), beta=float(theta[4]))
        try:
            draws.append(slope_of(s))
        except (FitError, ValueError, OverflowError):
            continue
    return main, float(np.std(draws)) if len(draws) > 1 else float("nan")


def choose_law(budgets, n, d, loss, *, n_boot: int = 100) -> dict[str, Any]:
    """The leave-largest-budget-out contest of the module docstring: ``{"law", "why", "scores"}``."""
    b, n, d, y = (np.asarray(v, dtype=float) for v in (budgets, n, d, loss))
    top = float(b.max())
    held = [p for p in fit_parabolas(b, n, d, y) if p.budget == top][0]
    rest = b != top
    scores: dict[str, float | None] = {}
    notes = []
    try:
        s = fit_loss_surface(n[rest], d[rest], y[rest], n_boot=0)
        scores["surface"] = abs(math.log(float(s.predict(held.n_opt, held.d_opt)) / held.loss_opt))
    except FitError as e:
        scores["surface"] = None
        notes.append(f"surface: {e}")
    try:
        front_rest = fit_parabolas(b[rest], n[rest], d[rest], y[rest])
    except FitError as e:
        front_rest = []
        notes.append(f"frontier laws: {e}")
    for law in ("pure", "saturating"):
        need = 2 if law == "pure" else 4
        if len(front_rest) < need:
            scores[law] = None
            notes.append(f"{law}: {len(front_rest)} budget(s) left after holding out the largest (needs {need})")
            continue
        f = fit_power_law([p.budget for p in front_rest], [p.loss_opt for p in front_rest], n_boot=0, form=law)
        scores[law] = abs(math.log(float(f.predict(top)) / held.loss_opt))
    eligible = {k: v for k, v in scores.items() if v is not None}
    if not eligible:
        raise FitError("no law can be tested by leaving the largest budget out: " + "; ".join(notes))
    best = min(eligible.values())
    law = min((k for k, v in eligible.items() if v <= best + TIE), key=LAW_PARAMS.get)
    why = ("leave-largest-budget-out |log error| on its measured optimum: "
           + ", ".join(f"{k} {v:.4f}" for k, v in eligible.items()) + ("; " + "; ".join(notes) if notes else ""))
    return {"law": law, "why": why, "scores": scores}


def analyse_metric(budgets, n, d, loss, *, fpt=None, n_boot: int = 200) -> dict[str, Any]:
    """Parabolas, frontier, surface, exponents and the chosen law for one metric (loss or bpb)."""
    parabolas = fit_parabolas(budgets, n, d, loss)
    front = frontier(parabolas)
    surface = fit_loss_surface(n, d, loss, n_boot=n_boot)
    sa = _surface_slope(surface, front["budgets"], fpt) if fpt is not None else (None, None)
    frontier_law = fit_power_law([p.budget for p in parabolas], [p.loss_opt for p in parabolas], n_boot=n_boot,
                                 form="pure")
    doc = {"parabolas": [p.to_json() for p in parabolas], "frontier": front, "surface": surface.to_json(),
           "exponents": compare_exponents(front, surface, surface_a=sa[0], surface_a_std=sa[1]),
           "frontier_law": frontier_law.to_json(), "selection": choose_law(budgets, n, d, loss)}
    return doc, surface, frontier_law


def predict_with(doc: dict[str, Any], surface: LossSurfaceFit, frontier_law: PowerLawFit, n: float, d: float,
                 flops: float) -> dict[str, Any]:
    """The chosen law's prediction (and band) for a run at (n, d) spending ``flops``."""
    law = doc["selection"]["law"]
    if law == "surface":
        value, (lo, hi) = float(surface.predict(n, d)), surface.band(n, d)
    else:
        f = frontier_law if law == frontier_law.form else fit_power_law(
            [p["budget"] for p in doc["parabolas"]], [p["loss_opt"] for p in doc["parabolas"]], n_boot=0, form=law)
        value, (lo, hi) = float(f.predict(flops)), f.band(flops)
    return {"law": law, "predicted": value, "low": lo, "high": hi}


def isoflop_document(runs: list[dict[str, Any]], *, recipe: RecipeSpace | None = None,
                     next_budget: float | None = None, validation: dict[str, Any] | None = None,
                     n_boot: int = 200) -> dict[str, Any]:
    """The ``isoflop.json`` document from the runs' values: each run a dict with ``name``, ``budget``,
    ``flops``, ``n``, ``d``, ``loss`` and, when evaluated, ``bpb`` and ``tasks`` (eval.json's)."""
    if not runs:
        raise FitError("an IsoFLOP fit got no runs")
    metrics = ["loss"] + (["bpb"] if all(r.get("bpb") is not None and math.isfinite(r["bpb"]) for r in runs) else [])
    primary = metrics[-1]
    fpt = recipe.flops_per_token_of() if recipe is not None else None
    cols = {k: [r[k] for r in runs] for k in ("budget", "n", "d")}
    doc: dict[str, Any] = {"metric": primary, "metrics": {},
                           "n_definition": "active parameters without embedding and output head",
                           "flops_model": "the recipe's FLOPs per token (6 x active matmul parameters with the "
                                          "output head, plus attention) x tokens" if fpt else "6 N D",
                           "runs": runs}
    fits = {}
    for m in metrics:
        try:
            mdoc, surface, flaw = analyse_metric(cols["budget"], cols["n"], cols["d"], [r[m] for r in runs], fpt=fpt,
                                                 n_boot=n_boot)
        except FitError as e:
            if m == primary:
                raise FitError(f"{m}: {e}") from None
            doc["metrics"][m] = {"error": str(e)}  # a secondary metric that cannot be fitted is reported, not fatal
            continue
        doc["metrics"][m] = mdoc
        fits[m] = (mdoc, surface, flaw)
    metrics = [m for m in metrics if m in fits]
    doc["surface"] = doc["metrics"][primary]["surface"]
    tasks = fit_task_laws(runs, n_boot=max(20, n_boot // 2))
    doc["tasks"] = {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in tasks.items()}
    if recipe is not None and next_budget is not None:
        best = predict_optimal_config(fits[primary][1], next_budget, recipe)
        n_opt, d_opt = fits[primary][1].optimal_allocation(next_budget, fpt)
        doc["next"] = {"budget": next_budget, "config": best.to_json(), "continuous_n_opt": n_opt,
                       "continuous_d_opt": d_opt,
                       "prediction": {m: predict_with(*fits[m], best.n, best.d, best.rung.flops) for m in metrics}}
        for name, entry in tasks.items():
            doc["next"].setdefault("tasks", {})[name] = predict_task(entry, best.n, best.d, best.rung.flops)
    if validation is not None:
        doc["validation"] = check_validation(fits, tasks, validation, metrics)
        doc["validation_rel_error"] = doc["validation"]["metrics"][primary]["rel_error"]
    return doc


def check_validation(fits, tasks, val: dict[str, Any], metrics: Sequence[str]) -> dict[str, Any]:
    """Predicted vs actual for the validation run (never fitted), per metric and per task."""
    out: dict[str, Any] = {"name": val["name"], "flops": val["flops"], "n": val["n"], "d": val["d"], "metrics": {},
                           "tasks": {}}
    for m in metrics:
        p = predict_with(*fits[m], val["n"], val["d"], val["flops"])
        actual = val.get(m)
        if actual is None:
            continue
        out["metrics"][m] = {**p, "actual": actual, "rel_error": (p["predicted"] - actual) / actual,
                             "inside": within_band(p["low"], actual, p["high"])}
    for name, entry in tasks.items():
        got = (val.get("tasks") or {}).get(name)
        if not got:
            continue
        out["tasks"][name] = verify_task(entry, val["n"], val["d"], val["flops"], got)
    return out


# ----------------------------------------------------------------------------------------------
# plots (matplotlib PNGs next to isoflop.json; the HTML report draws its own SVG from the document)


def write_plots(doc: dict[str, Any], output_path: str) -> list[str]:
    import matplotlib  # matplotlib: the plots extra (slow to import), only when drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after choosing the Agg backend)

    m = doc["metric"]
    md = doc["metrics"][m]
    runs = doc["runs"]
    names = []

    def save(ax, name, **labels):
        names.append(finish_plot(ax, output_path, name, **labels))

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, p in enumerate(md["parabolas"]):
        pts = [r for r in runs if r["budget"] == p["budget"]]
        ns = np.array([r["n"] for r in pts])
        ax.scatter(ns, [r[m] for r in pts], color=f"C{i}", zorder=3)
        grid = np.exp(np.linspace(math.log(ns.min()) - 0.3, math.log(ns.max()) + 0.3, 80))
        c2, c1, c0 = p["coef"]
        x = np.log(grid)
        ax.plot(grid, c2 * x ** 2 + c1 * x + c0, color=f"C{i}", label=f"C = {p['budget']:.3g}")
        ax.plot([p["n_opt"]], [p["loss_opt"]], "v", color=f"C{i}", ms=9)
    f = md["frontier"]
    ax.plot([p["n_opt"] for p in md["parabolas"]], [p["loss_opt"] for p in md["parabolas"]], "k--", lw=1,
            label=f"frontier: N_opt ∝ C^{f['a']:.2f}±{f['a_std']:.2f}")
    v = doc.get("validation")
    if v and m in v["metrics"]:
        ax.scatter([v["n"]], [v["metrics"][m]["actual"]], marker="*", s=160, color="C3", zorder=4,
                   label=f"validation {v['name']}: {100 * v['metrics'][m]['rel_error']:+.1f}%")
        ax.errorbar([v["n"]], [v["metrics"][m]["predicted"]],
                    yerr=[[v["metrics"][m]["predicted"] - v["metrics"][m]["low"]],
                          [v["metrics"][m]["high"] - v["metrics"][m]["predicted"]]], fmt="s", color="k", capsize=4,
                    label="predicted (band)")
    ax.set_xscale("log")
    save(ax, "isoflop.png", xlabel="active parameters N", ylabel=m,
         title="IsoFLOP parabolas and the compute-optimal frontier")

    s = LossSurfaceFit.from_json(md["surface"])
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ns = np.array([r["n"] for r in runs] + ([v["n"]] if v else []))
    ds = np.array([r["d"] for r in runs] + ([v["d"]] if v else []))
    gn = np.exp(np.linspace(math.log(ns.min()) - 0.5, math.log(ns.max()) + 0.5, 60))
    gd = np.exp(np.linspace(math.log(ds.min()) - 0.5, math.log(ds.max()) + 0.5, 60))
    NN, DD = np.meshgrid(gn, gd)
    cs = ax.contour(NN, DD, s.predict(NN.ravel(), DD.ravel()).reshape(NN.shape), levels=12, cmap="viridis")
    ax.clabel(cs, fontsize=6, fmt="%.3g")
    ax.scatter([r["n"] for r in runs], [r["d"] for r in runs], c="k", s=14, label="runs (fitted)")
    ax.plot([p["n_opt"] for p in md["parabolas"]], [p["d_opt"] for p in md["parabolas"]], "rv-", label="IsoFLOP optima")
    if v:
        ax.scatter([v["n"]], [v["d"]], marker="*", s=160, color="C3", label=f"validation {v['name']}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    save(ax, "surface.png", xlabel="active parameters N", ylabel="training tokens D",
         title=f"loss surface: {m} = {s.E:.3g} + {s.A:.3g}/N^{s.alpha:.2f} + {s.B:.3g}/D^{s.beta:.2f}")
    return names


# ----------------------------------------------------------------------------------------------
# the executor step


@dataclasses.dataclass(frozen=True)
class IsoFlopRun:
    """One run of the grid (or the validation run): its budget, model and schedule, and outputs."""

    name: str
    budget: float
    model: MoEConfig
    train_steps: int
    tokens_per_step: int
    seq_len_phases: tuple[tuple[float, int], ...]
    run_path: str | None = input_field(default=None)
    eval_path: str | None = input_field(default=None)


@dataclasses.dataclass(frozen=True)
class IsoFlopFitConfig:
    runs: tuple[IsoFlopRun, ...] = by_field("each run's fields are versioned leaves (runs[0].budget)")
    output_path: str = input_field()
    recipe: RecipeSpace | None = None
    next_budget: float | None = None
    validation: IsoFlopRun | None = by_field("the validation run's fields as versioned leaves", default=None)
    n_boot: int = 200
    max_validation_rel_error: float | None = live(
        "a pass/fail threshold checked on the finished fit; it changes no output file", default=None)
    """When set, the step fails (after writing isoflop.json) beyond this validation error."""


def _run_values(run: IsoFlopRun) -> dict[str, Any]:
    records, final_eval = read_fit_inputs(run.run_path, run.eval_path)
    train = [r for r in records if r.get("kind", "train") == "train" and "loss" in r]
    if not train:
        raise FitError(f"run {run.name}: no training records in {run.run_path}/metrics.jsonl")
    if train[-1]["step"] < run.train_steps:
        raise FitError(f"run {run.name}: metrics stop at step {train[-1]['step']} of {run.train_steps}; unfinished")
    c = count_params(run.model)
    row = {"name": run.name, "budget": run.budget,
           "flops": run_flops(run.model, run.train_steps, run.tokens_per_step, run.seq_len_phases),
           "width": run.model.d_model, "layers": run.model.n_layers, "n": float(c["active_params"]),
           "d": float(run.train_steps * run.tokens_per_step), "train_steps": run.train_steps,
           "loss": window_mean(train, "loss", run.train_steps, run.train_steps)}
    if final_eval is not None:
        row["bpb"] = final_eval.get("macro_bpb")
        if final_eval.get("tasks"):
            row["tasks"] = final_eval["tasks"]
    return row


def isoflop_fit_step(config: IsoFlopFitConfig) -> dict[str, Any]:
    """Executor step: ``isoflop.json`` and ``isoflop.png`` / ``surface.png`` (see the module docstring)."""
    runs = [_run_values(r) for r in config.runs]
    val = _run_values(config.validation) if config.validation is not None else None
    doc = isoflop_document(runs, recipe=config.recipe, next_budget=config.next_budget, validation=val,
                           n_boot=config.n_boot)
    doc["plots"] = write_plots(doc, config.output_path)
    with fsspec.open(f"{config.output_path.rstrip('/')}/isoflop.json", "w") as f:
        json.dump(clean_json(doc), f, indent=1)
    err = doc.get("validation_rel_error")
    limit = config.max_validation_rel_error
    if limit is not None and err is not None and not abs(err) <= limit:
        v = doc["validation"]["metrics"][doc["metric"]]
        raise FitError(f"validation run {config.validation.name}: {doc['metric']} predicted {v['predicted']:.4f}, "
                       f"got {v['actual']:.4f} ({100 * err:+.1f}%, limit {100 * limit:.0f}%)")
    return {"isoflop": f"{config.output_path.rstrip('/')}/isoflop.json", "validation_rel_error": err}


def read_isoflop(path: str) -> dict[str, Any]:
    """An ``isoflop.json`` (its path, or the step's directory)."""
    if not path.rstrip("/").endswith(".json"):
        path = f"{path.rstrip('/')}/isoflop.json"
    with fsspec.open(path, "r") as f:
        return json.load(f)
